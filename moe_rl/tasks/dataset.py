"""Prompt datasets: the task `"dataset"` for user data, read with HF `datasets`.

`rollout.dataset` is a `.jsonl`/`.json` file, a `.parquet` file, a directory of such files (one
format), or a directory written by `Dataset.save_to_disk` (a `DatasetDict` gives its "train"
split, or its only one). It is read offline, local files only: `load_dataset` converts JSON and
Parquet once into an Arrow file in the `datasets` cache (`HF_DATASETS_CACHE`), which is then
memory-mapped, so a large dataset costs page cache, not process memory. No Python list of rows is
kept: `prompts(seed)` draws a seeded permutation of the row indices each epoch (every row once per
epoch, endless) and reads and tokenises one row when it is drawn.

Columns, named by `RolloutConfig`'s keys (dotted paths reach into nested columns, e.g. verl's
`reward_model.ground_truth`):
- `prompt_key` ("prompt"): text, or a list of chat messages `[{"role": ..., "content": ...}]`
  (verl's and slime's layout) rendered with the model's chat template, the row's tools and the
  generation prompt; the Prompt keeps `messages` and `tools` for agents. Text is tokenised as it
  is, or with `apply_chat_template` rendered as one user message. Alternatively a `prompt_ids`
  column of token ids; each row gives exactly one of the two. A message has a `role` and a
  `content` (text or a list of parts; null only on an assistant message with `tool_calls`, each
  naming its function).
- `answer_key` ("answer"): what the reward compares the response with; null counts as missing.
- `tools_key` ("tools"), optional column: an OpenAI function list (`{"type": "function",
  "function": {"name": ..., "parameters": {...}}}`), or its JSON text (slime).
  Keys whose value is null are dropped from tools and messages: Arrow gives every row the union
  of the keys of all rows.
- `metadata_keys`: columns copied into the prompt's metadata; the `metadata` column's fields go
  to its top level, any other column under its name. None: `metadata` if present, plus verl's
  `data_source`, `ability` and `extra_info` where present.

With `for_agents` (`rollout.agent` is set) every row must be a chat (or text, with
`apply_chat_template`): the Prompt carries the messages, tools and metadata, no ids (each episode
renders the messages with its own chat format, turn by turn).

A column holds one type across rows; `datasets` reads a JSONL column whose rows mix types (text
and lists) as JSON, and then a text value that parses as JSON comes back parsed ("4" as 4).
Everything cheap is checked up front, before any process starts: the columns exist (the error
names the key and the columns the file has), and every row's prompt, answer, tools and metadata,
scanned in Arrow batches of `SCAN_ROWS` rows (vectorised where Arrow typed the column; the first
bad row is then decoded to say what is wrong with it). Errors are `ValueError`s naming
`rollout.dataset`, the row (`row N` is `dataset[N]`, counted from 0) and the key. Prompts are
tokenised with the HF tokenizer of `tokenizer_dir` (model.tokenizer or model.path; local files
only). The reward is named by `reward` (see `moe_rl.tasks.registry.get_reward`; default "math").
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from moe_rl.agents.chat import ChatFormat, load_tokenizer
from moe_rl.sample import Sample
from moe_rl.tasks.registry import Prompt, Task, get_reward, register_task

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
"""File suffix -> the `datasets` builder that reads it."""
VERL_METADATA = ("data_source", "ability", "extra_info")
SCAN_ROWS = 4096
"""Rows per Arrow batch of the up-front check (bounds its memory)."""


def open_dataset(path: str | Path):
    """`path` as an Arrow-backed, memory-mapped `datasets.Dataset`, read offline."""
    import datasets  # heavy (pandas, fsspec, huggingface_hub): only where a dataset is read

    path = Path(path)
    where = f"rollout.dataset={str(path)!r}"
    if not path.exists():
        raise ValueError(f"{where}: no such file or directory")
    with _offline(datasets):
        if path.is_dir() and any((path / name).is_file() for name in ("state.json", "dataset_dict.json")):
            data = datasets.load_from_disk(str(path))
            if isinstance(data, datasets.DatasetDict):
                if "train" not in data and len(data) != 1:
                    raise ValueError(f"{where}: a DatasetDict with splits {list(data)}: give one split's directory")
                data = data["train"] if "train" in data else next(iter(data.values()))
            return data
        files = [path]
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.suffix in BUILDERS and not p.name.startswith("."))
            if not files:
                raise ValueError(f"{where}: no .jsonl, .json or .parquet files in the directory")
        builders = {BUILDERS.get(p.suffix) for p in files}
        if None in builders:
            raise ValueError(
                f"{where}: unsupported file type {path.suffix!r}; give a .jsonl, .json or .parquet file, a "
                "directory of them, or a directory written by Dataset.save_to_disk"
            )
        if len(builders) > 1:
            raise ValueError(f"{where}: the directory mixes JSON and Parquet files; keep one format")
        if all(p.stat().st_size == 0 for p in files):
            raise ValueError(f"{where}: no rows (empty file)")  # load_dataset fails with a bare StopIteration
        builder = builders.pop()
        try:
            return datasets.load_dataset(builder, data_files=[str(p) for p in files], split="train")
        except Exception as error:  # datasets wraps the reader's error
            if builder == "json":  # pyarrow names a row within its read block, counted from 0: find the line
                _check_json_lines(files, where)
            reason = error.__cause__ or error
            raise ValueError(f"{where}: cannot read it ({type(reason).__name__}: {reason})") from error


def _check_json_lines(files: list[Path], where: str) -> None:
    """ValueError naming the line (counted from 1, and the file in a directory) of the first text
    that is not JSON: a line of a JSON-lines file, or where a one-document .json file stops parsing."""
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        bad, number = _json_error(text), None
        if bad is None or not text.strip():
            continue  # one JSON document (an array of rows), or nothing
        lines = text.splitlines()
        if _json_error(next(line for line in lines if line.strip())) is None:  # JSON lines: the first bad one
            bad, number = next(
                ((e, n) for n, line in enumerate(lines, 1) if line.strip() and (e := _json_error(line))), (None, None)
            )
        if bad is not None:
            at = "" if len(files) == 1 else f" file {path.name}"
            raise ValueError(f"{where}{at} line {number or bad.lineno} is not JSON ({bad.msg}): fix or remove it")


def _json_error(text: str) -> json.JSONDecodeError | None:
    try:
        json.loads(text)
    except json.JSONDecodeError as error:
        return error
    return None


@contextlib.contextmanager
def _offline(datasets):
    """No network, no progress bars, no log lines: a refusal before start prints one line, nothing else."""
    saved, datasets.config.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE, True
    bars_were_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its reader logs a parse error before raising it
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)
        datasets.config.HF_HUB_OFFLINE = saved
        if bars_were_on:
            datasets.enable_progress_bars()


@register_task("dataset")
class DatasetTask(Task):
    """Prompts of a user dataset (the module docstring); `len(task)` is its number of rows."""

    def __init__(
        self,
        path: str | Path | None = None,
        tokenizer_dir: str | Path | None = None,
        reward: str = "math",
        apply_chat_template: bool = False,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        tools_key: str = "tools",
        metadata_keys: list[str] | None = None,
        for_agents: bool = False,
    ):
        if path is None:
            raise ValueError(
                "rollout.task='dataset' needs rollout.dataset (a JSONL or Parquet file, a directory of them, "
                "or a directory written by Dataset.save_to_disk)"
            )
        self.where = f"rollout.dataset={str(path)!r}"
        data = open_dataset(path)
        if len(data) == 0:
            raise ValueError(f"{self.where}: no rows")
        schema = data.data.schema
        self.prompt_key = prompt_key if _type_at(schema, prompt_key) is not None else None
        self.ids_key = "prompt_ids" if "prompt_ids" in schema.names else None
        if self.prompt_key is None and self.ids_key is None:
            raise self._no_column(schema, prompt_key, "prompt_key", "; or give token ids in a 'prompt_ids' column")
        if _type_at(schema, answer_key) is None:
            raise self._no_column(schema, answer_key, "answer_key")
        self.answer_key = answer_key
        self.tools_key = tools_key if _type_at(schema, tools_key) is not None else None
        if metadata_keys is None:
            metadata_keys = [key for key in ("metadata", *VERL_METADATA) if key in schema.names]
        for key in metadata_keys:
            if _type_at(schema, key) is None:
                raise self._no_column(schema, key, "metadata_keys")
        self.metadata_keys = list(metadata_keys)
        self._reward = get_reward(reward)
        self.apply_chat_template, self.for_agents = apply_chat_template, for_agents
        keys = [self.prompt_key, self.ids_key, self.answer_key, self.tools_key, *self.metadata_keys]
        self.data = data.select_columns(list(dict.fromkeys(key.split(".")[0] for key in keys if key)))
        chats = self._scan(schema)
        self._load_tokenizer(tokenizer_dir, chats)

    def _no_column(self, schema: pa.Schema, key: str, field: str, more: str = "") -> ValueError:
        return ValueError(
            f"{self.where}: no column {key!r} (rollout.{field}){more}; the file has columns {_names(schema)}"
        )

    def _load_tokenizer(self, tokenizer_dir, chats: bool) -> None:
        self.tokenizer = self.chat = None
        needs_tokenizer = self.prompt_key is not None
        if tokenizer_dir is None and needs_tokenizer:
            raise ValueError(
                f"{self.where} has text or chat prompts: set model.tokenizer (or model.path) to a directory with "
                "the model's tokenizer, or give prompt_ids"
            )
        if tokenizer_dir is not None:
            try:
                self.tokenizer = load_tokenizer(tokenizer_dir)
            except ValueError:
                if needs_tokenizer:
                    raise
        if self.tokenizer is not None and (chats or (self.apply_chat_template and needs_tokenizer)):
            self.chat = ChatFormat(self.tokenizer)

    def _scan(self, schema: pa.Schema) -> bool:
        """Check every row, SCAN_ROWS at a time: typed columns as Arrow arrays, columns holding JSON
        (rows of mixed types) decoded; the first bad row is decoded to say what is wrong with it.
        Returns whether any prompt is a list of chat messages."""
        metadata = "metadata" if "metadata" in self.metadata_keys else None
        typed = [
            (self.prompt_key, "prompt"),
            (self.ids_key, "prompt_ids"),
            (self.tools_key, "tools"),
            (metadata, "metadata"),
        ]
        for key, kind in typed:
            allowed, reason = COLUMN_TYPES[kind]
            dtype = _type_at(schema, key) if key else None
            if dtype is not None and not allowed(dtype):
                raise ValueError(f"{self.where}: column {key!r} is {dtype}: {reason}")
        arrow, chats = self.data.with_format("arrow"), False
        for start in range(0, len(self.data), SCAN_ROWS):
            batch = _Batch(arrow[start : start + SCAN_ROWS], self.data, start)
            size = batch.table.num_rows
            no_text = batch.nulls(self.prompt_key) if self.prompt_key else np.ones(size, bool)
            no_ids = batch.nulls(self.ids_key) if self.ids_key else np.ones(size, bool)
            what = f"{self.prompt_key!r} (rollout.prompt_key)" if self.prompt_key else "'prompt_ids'"
            if self.prompt_key and self.ids_key:
                what = f"{what} or 'prompt_ids'"
                self._fail(start, ~no_text & ~no_ids, f"give either {what}, not both")
            self._fail(start, no_text & no_ids, f"no {what}")
            self._fail(
                start,
                batch.nulls(self.answer_key),
                f"no {self.answer_key!r} (rollout.answer_key): what the reward compares the response with",
            )
            if self.prompt_key:
                bad, chat_rows = batch.prompt_errors(self.prompt_key)
                self._fail(start, bad, COLUMN_TYPES["prompt"][1], self.prompt_key, prompt_problem)
                chats = chats or bool(chat_rows.any())
                if self.for_agents and not self.apply_chat_template:
                    self._fail(start, ~no_text & ~chat_rows, AGENT_TEXT, self.prompt_key, prompt_problem)
            if self.ids_key:
                self._fail(start, batch.ids_errors(self.ids_key), COLUMN_TYPES["prompt_ids"][1])
                if self.for_agents:
                    self._fail(start, ~no_ids, AGENT_IDS)
            if self.tools_key:
                bad = batch.tools_errors(self.tools_key)
                self._fail(start, bad, COLUMN_TYPES["tools"][1], self.tools_key, tools_problem)
            if "metadata" in self.metadata_keys:
                self._fail(start, batch.python_errors("metadata", _metadata_ok), COLUMN_TYPES["metadata"][1])
        return chats

    def _fail(self, start: int, bad: np.ndarray, reason: str, key: str | None = None, problem=None) -> None:
        """Raise for the first `bad` row, naming the row, the column `key` (with its rollout field)
        and what `problem(value)` finds wrong with that row's value."""
        if not bad.any():
            return
        row = start + int(np.argmax(bad))
        if key is not None:
            label = f"{key!r} (rollout.{'tools_key' if key == self.tools_key else 'prompt_key'})"
            detail = problem(_get(self.data[row], key)) if problem else None
            reason = f"{label} {detail}: {reason}" if detail else f"{label}: {reason}"
        raise ValueError(f"{self.where} row {row}: {reason}")

    def __len__(self) -> int:
        return len(self.data)

    def prompt(self, index: int) -> Prompt:
        """Row `index`, read from the memory-mapped table and tokenised now (nothing is cached). For
        agents the messages are not tokenised here: each episode renders them with its chat format."""
        row = self.data[index]
        text, ids = _get(row, self.prompt_key), row.get(self.ids_key) if self.ids_key else None
        tools = clean_tools(_get(row, self.tools_key))
        messages = None
        if isinstance(text, list):
            messages = [{k: v for k, v in m.items() if v is not None} for m in text]
        elif text is not None and self.apply_chat_template:
            messages = [{"role": "user", "content": text}]
        if messages is not None:
            ids = [] if self.for_agents else self.chat.prompt_ids(messages, tools)
        elif text is not None:
            ids = self.tokenizer(text, add_special_tokens=True)["input_ids"]
        metadata = {}
        for key in self.metadata_keys:
            value = _get(row, key)
            if key == "metadata":
                metadata.update(value or {})
            elif value is not None:
                metadata[key] = value
        answer = _get(row, self.answer_key)
        return Prompt(prompt_ids=list(ids), answer=answer, metadata=metadata, messages=messages, tools=tools)

    def prompts(self, seed: int) -> Iterator[Prompt]:
        rng = np.random.default_rng(seed)
        while True:
            for index in rng.permutation(len(self.data)):
                yield self.prompt(int(index))

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return " ".join(map(str, ids))
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def reward(self, response: str, answer: Any, sample: Sample) -> float:
        return float(self._reward(response, answer, sample))


def clean_tools(tools: Any) -> list[dict] | None:
    """A row's tools as OpenAI function dicts: JSON text parsed, null-valued keys dropped."""
    if isinstance(tools, str):
        tools = json.loads(tools)
    return [_drop_nulls(tool) for tool in tools] if tools else None


def _drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def _get(row: dict, key: str | None) -> Any:
    """The value at a dotted path of a decoded row; None where any part is missing."""
    value: Any = row if key else None
    for part in key.split(".") if key else ():
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _type_at(schema: pa.Schema, key: str) -> pa.DataType | None:
    """The Arrow type at a dotted path through struct columns, None where there is none. A JSON
    column (rows of mixed types) ends the walk: the rest of the path is checked row by row."""
    top, *rest = key.split(".")
    if top not in schema.names:
        return None
    dtype = schema.field(top).type
    for part in rest:
        if isinstance(dtype, pa.JsonType):
            return dtype
        if not pa.types.is_struct(dtype) or dtype.get_field_index(part) < 0:
            return None
        dtype = dtype.field(part).type
    return dtype


def _names(schema: pa.Schema) -> list[str]:
    """Column names, nested struct fields as dotted paths (what the keys may name)."""

    def walk(prefix: str, dtype: pa.DataType) -> list[str]:
        if not pa.types.is_struct(dtype):
            return [prefix]
        return [name for f in dtype for name in walk(f"{prefix}.{f.name}", f.type)]

    return [name for f in schema for name in walk(f.name, f.type)]


def _column(batch: pa.Table, key: str) -> pa.Array:
    """The Arrow array at a dotted path of a batch (struct fields only; see `_type_at`)."""
    top, *rest = key.split(".")
    array = batch.column(top).combine_chunks()
    for part in rest:
        array = pc.struct_field(array, [part])
    return array


class _Batch:
    """SCAN_ROWS rows of the needed columns: Arrow arrays, or decoded values for JSON columns."""

    def __init__(self, table: pa.Table, data, start: int):
        self.table, self.data, self.start = table, data, start

    def plain(self, key: str) -> bool:
        return _plain(_type_at(self.table.schema, key))

    def decoded(self, key: str) -> list:
        top = key.split(".")[0]
        values = self.data.select_columns([top])[self.start : self.start + self.table.num_rows][top]
        return [_get({top: value}, key) for value in values]

    def nulls(self, key: str) -> np.ndarray:
        if self.plain(key):
            return _column(self.table, key).is_null().to_numpy(zero_copy_only=False)
        return np.array([value is None for value in self.decoded(key)], bool)

    def python_errors(self, key: str, ok) -> np.ndarray:
        """Rows whose decoded value fails `ok` (only columns that are text or JSON need it)."""
        dtype = _type_at(self.table.schema, key)
        if self.plain(key) and not pa.types.is_string(dtype) and not pa.types.is_large_string(dtype):
            return np.zeros(self.table.num_rows, bool)  # typed by Arrow: every row has the column's type
        return np.array([value is not None and not ok(value) for value in self.decoded(key)], bool)

    def prompt_errors(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """Bad prompt rows, and which rows are chats. Arrow-typed chats: every message has a role,
        and content unless it is an assistant message with tool calls."""
        if not self.plain(key):
            values = self.decoded(key)
            bad = [value is not None and not isinstance(value, str) and prompt_problem(value) for value in values]
            return np.array(bad, bool), np.array([isinstance(value, list) for value in values], bool)
        array = _column(self.table, key)
        if not pa.types.is_list(array.type) and not pa.types.is_large_list(array.type):
            return np.zeros(len(array), bool), np.zeros(len(array), bool)
        messages = array.flatten()
        role, content, calls = (_field(messages, name) for name in ("role", "content", "tool_calls"))
        flags = pc.or_kleene(pc.is_null(role), pc.equal(role, ""))
        no_content = pc.is_null(content)
        if calls is not None and (pa.types.is_list(calls.type) or pa.types.is_large_list(calls.type)):
            calling = pc.and_kleene(pc.equal(role, "assistant"), pc.greater(pc.list_value_length(calls), 0))
            no_content = pc.and_kleene(no_content, pc.invert(calling.fill_null(False)))
        bad = _rows_with(array, pc.or_kleene(flags, no_content))
        bad |= pc.equal(pc.list_value_length(array), 0).fill_null(False).to_numpy(zero_copy_only=False)
        return bad, array.is_valid().to_numpy(zero_copy_only=False)

    def tools_errors(self, key: str) -> np.ndarray:
        """Bad tools rows. Arrow-typed tools: each has type "function" and a function name."""
        dtype = _type_at(self.table.schema, key)
        if not self.plain(key) or pa.types.is_string(dtype) or pa.types.is_large_string(dtype):
            return np.array([value is not None and tools_problem(value) is not None for value in self.decoded(key)])
        array = _column(self.table, key)
        tools = array.flatten()
        kind, name = _field(tools, "type"), _field(tools, "function", "name")
        if kind is None or name is None or not _is_text(kind.type) or not _is_text(name.type):
            return _rows_with(array, pa.repeat(True, len(tools)))  # no tool names a function
        flags = pc.invert(pc.and_kleene(pc.equal(kind, "function"), pc.greater(pc.utf8_length(name), 0)))
        parameters = _field(tools, "function", "parameters")
        if parameters is not None and not (pa.types.is_struct(parameters.type) or pa.types.is_null(parameters.type)):
            flags = pc.or_kleene(flags, parameters.is_valid())
        return _rows_with(array, flags)

    def ids_errors(self, key: str) -> np.ndarray:
        array = _column(self.table, key)
        bad = _rows_with(array, pc.less(array.flatten(), 0))
        return bad | pc.equal(pc.list_value_length(array), 0).fill_null(False).to_numpy(zero_copy_only=False)


def _field(array: pa.Array, *path: str) -> pa.Array | None:
    """The struct field at `path` of a struct array; None where its type has no such field."""
    for name in path:
        if not pa.types.is_struct(array.type) or array.type.get_field_index(name) < 0:
            return None
        array = pc.struct_field(array, [name])
    return array


def _is_text(dtype: pa.DataType) -> bool:
    return pa.types.is_string(dtype) or pa.types.is_large_string(dtype)


def _rows_with(lists: pa.Array, flags: pa.Array) -> np.ndarray:
    """Per list row: whether any of its values is flagged (flags run over `lists.flatten()`)."""
    bad = np.zeros(len(lists), bool)
    parents = pc.list_parent_indices(lists).to_numpy(zero_copy_only=False)
    bad[parents[flags.fill_null(True).to_numpy(zero_copy_only=False)]] = True
    return bad


def _plain(dtype: pa.DataType | None) -> bool:
    """No JSON anywhere in the type: Arrow's own checks apply."""
    if dtype is None or isinstance(dtype, pa.JsonType):
        return dtype is None
    if pa.types.is_struct(dtype):
        return all(_plain(f.type) for f in dtype)
    if pa.types.is_list(dtype) or pa.types.is_large_list(dtype):
        return _plain(dtype.value_type)
    return True


def _prompt_type(dtype: pa.DataType) -> bool:
    if not _plain(dtype) or _is_text(dtype):
        return True
    if not (pa.types.is_list(dtype) or pa.types.is_large_list(dtype)) or not pa.types.is_struct(dtype.value_type):
        return False
    message = dtype.value_type
    if message.get_field_index("content") < 0 or message.get_field_index("role") < 0:
        return False
    content = message.field("content").type
    is_list = pa.types.is_list(content) or pa.types.is_large_list(content)
    return _is_text(message.field("role").type) and (_is_text(content) or is_list or pa.types.is_null(content))


def _ids_type(dtype: pa.DataType) -> bool:
    return (pa.types.is_list(dtype) or pa.types.is_large_list(dtype)) and pa.types.is_integer(dtype.value_type)


def _tools_type(dtype: pa.DataType) -> bool:
    if not _plain(dtype) or _is_text(dtype):
        return True
    return (pa.types.is_list(dtype) or pa.types.is_large_list(dtype)) and pa.types.is_struct(dtype.value_type)


def _metadata_type(dtype: pa.DataType) -> bool:
    return not _plain(dtype) or pa.types.is_struct(dtype)


COLUMN_TYPES = {  # kind -> (whether an Arrow type can hold it, what a row or column must be)
    "prompt": (
        _prompt_type,
        "a prompt is text or a non-empty list of {'role': ..., 'content': ...} chat messages (content may be "
        "null only on an assistant message with tool_calls)",
    ),
    "prompt_ids": (_ids_type, "'prompt_ids' is a non-empty list of token ids >= 0"),
    "tools": (
        _tools_type,
        "tools are a list of OpenAI function definitions "
        "({'type': 'function', 'function': {'name': ..., 'parameters': {...}}}), or its JSON text",
    ),
    "metadata": (_metadata_type, "'metadata' is an object"),
}
AGENT_TEXT = (
    "rollout.agent needs chat messages: give a list of {'role': ..., 'content': ...} messages, or set "
    "rollout.apply_chat_template: true to send the text as one user message"
)
AGENT_IDS = "'prompt_ids' are token ids, and rollout.agent needs chat messages in the rollout.prompt_key column"


def prompt_problem(value: Any) -> str | None:
    """What is wrong with a row's prompt (text, or chat messages); None when nothing is."""
    if isinstance(value, str):
        return "is text"  # only wrong for agents (the scan asks only then)
    if not isinstance(value, list) or not value:
        return "is an empty list" if isinstance(value, list) else f"is a {type(value).__name__}"
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            return f"message {i} is not an object"
        role, content, calls = message.get("role"), message.get("content"), message.get("tool_calls")
        if not isinstance(role, str) or not role:
            return f"message {i} has no 'role'"
        if content is None and not (role == "assistant" and calls):
            return f"message {i} ({role}) has no 'content'"
        if content is not None and not isinstance(content, (str, list)):
            return f"message {i} ({role}) has a {type(content).__name__} 'content', not text"
        if calls is not None and not isinstance(calls, list):
            return f"message {i} ({role}) has 'tool_calls' that are not a list"
        for j, call in enumerate(calls or []):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                return f"message {i} ({role}) tool_calls[{j}] has no function name"
    return None


def tools_problem(value: Any) -> str | None:
    """What is wrong with a row's tools (OpenAI function definitions, or their JSON text); None
    when nothing is."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as error:
            return f"is not valid JSON ({error})"
    if not isinstance(value, list):
        return f"is a {type(value).__name__}, not a list"
    for i, tool in enumerate(_drop_nulls(value)):
        if not isinstance(tool, dict):
            return f"tools[{i}] is not an object"
        if tool.get("type") != "function":
            return f"tools[{i}] has type {tool.get('type')!r}, not 'function'"
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            return f"tools[{i}] has no function name"
        if not isinstance(function.get("parameters", {}), dict):
            return f"tools[{i}] has parameters that are not an object (a JSON Schema)"
    return None


def _metadata_ok(value: Any) -> bool:
    return isinstance(value, dict)
