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
  column of token ids; each row gives exactly one of the two.
- `answer_key` ("answer"): what the reward compares the response with; null counts as missing.
- `tools_key` ("tools"), optional column: an OpenAI function list, or its JSON text (slime).
  Keys whose value is null are dropped from tools and messages: Arrow gives every row the union
  of the keys of all rows.
- `metadata_keys`: columns copied into the prompt's metadata; the `metadata` column's fields go
  to its top level, any other column under its name. None: `metadata` if present, plus verl's
  `data_source`, `ability` and `extra_info` where present.

A column holds one type across rows; `datasets` reads a JSONL column whose rows mix types (text
and lists) as JSON, and then a text value that parses as JSON comes back parsed ("4" as 4).
Everything cheap is checked up front, before any process starts: the columns exist (the error
names the key and the columns the file has), and every row's prompt, answer, tools and metadata,
scanned in Arrow batches of `SCAN_ROWS` rows. Errors are `ValueError`s naming `rollout.dataset`
and the row (`row N` is `dataset[N]`, counted from 0). Prompts are tokenised with the HF
tokenizer of `tokenizer_dir` (model.tokenizer or model.path; local files only). The reward is
named by `reward` (see `moe_rl.tasks.registry.get_reward`; default `"math"`).
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
        try:
            return datasets.load_dataset(builders.pop(), data_files=[str(p) for p in files], split="train")
        except Exception as error:  # datasets wraps the reader's error (a JSON parse error names its row)
            reason = error.__cause__ or error
            raise ValueError(f"{where}: cannot read it ({type(reason).__name__}: {reason})") from error


@contextlib.contextmanager
def _offline(datasets):
    """No network, and no progress bars: a refusal before start prints one line, nothing else."""
    saved, datasets.config.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE, True
    bars_were_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
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
        self.apply_chat_template = apply_chat_template
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
        (rows of mixed types) decoded. Returns whether any prompt is a list of chat messages."""
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
                bad, row_chats = batch.prompt_errors(self.prompt_key)
                self._fail(start, bad, COLUMN_TYPES["prompt"][1])
                chats = chats or row_chats
            if self.ids_key:
                self._fail(start, batch.ids_errors(self.ids_key), COLUMN_TYPES["prompt_ids"][1])
            if self.tools_key:
                self._fail(start, batch.python_errors(self.tools_key, _tools_ok), COLUMN_TYPES["tools"][1])
            if "metadata" in self.metadata_keys:
                self._fail(start, batch.python_errors("metadata", _metadata_ok), COLUMN_TYPES["metadata"][1])
        return chats

    def _fail(self, start: int, bad: np.ndarray, reason: str) -> None:
        if bad.any():
            raise ValueError(f"{self.where} row {start + int(np.argmax(bad))}: {reason}")

    def __len__(self) -> int:
        return len(self.data)

    def prompt(self, index: int) -> Prompt:
        """Row `index`, read from the memory-mapped table and tokenised now (nothing is cached)."""
        row = self.data[index]
        text, ids = _get(row, self.prompt_key), row.get(self.ids_key) if self.ids_key else None
        tools = clean_tools(_get(row, self.tools_key))
        messages = None
        if isinstance(text, list):
            messages = [{k: v for k, v in m.items() if v is not None} for m in text]
        elif text is not None and self.apply_chat_template:
            messages = [{"role": "user", "content": text}]
        if messages is not None:
            ids = self.chat.prompt_ids(messages, tools)
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

    def prompt_errors(self, key: str) -> tuple[np.ndarray, bool]:
        """Bad prompt rows and whether any row is a chat; Arrow-typed chats: a role in every message."""
        if not self.plain(key):
            values = self.decoded(key)
            bad = [value is not None and not (isinstance(value, str) or _messages_ok(value)) for value in values]
            return np.array(bad, bool), any(isinstance(value, list) for value in values)
        array = _column(self.table, key)
        if not pa.types.is_list(array.type) and not pa.types.is_large_list(array.type):
            return np.zeros(len(array), bool), False
        bad = _rows_with(array, pc.is_null(pc.struct_field(array.flatten(), ["role"])))
        bad |= pc.equal(pc.list_value_length(array), 0).fill_null(False).to_numpy(zero_copy_only=False)
        return bad, array.null_count < len(array)

    def ids_errors(self, key: str) -> np.ndarray:
        array = _column(self.table, key)
        bad = _rows_with(array, pc.less(array.flatten(), 0))
        return bad | pc.equal(pc.list_value_length(array), 0).fill_null(False).to_numpy(zero_copy_only=False)


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
    if not _plain(dtype) or pa.types.is_string(dtype) or pa.types.is_large_string(dtype):
        return True
    if not (pa.types.is_list(dtype) or pa.types.is_large_list(dtype)) or not pa.types.is_struct(dtype.value_type):
        return False
    message = dtype.value_type
    return message.get_field_index("content") >= 0 and message.get_field_index("role") >= 0


def _ids_type(dtype: pa.DataType) -> bool:
    return (pa.types.is_list(dtype) or pa.types.is_large_list(dtype)) and pa.types.is_integer(dtype.value_type)


def _tools_type(dtype: pa.DataType) -> bool:
    return not _plain(dtype) or pa.types.is_list(dtype) or pa.types.is_string(dtype) or pa.types.is_large_string(dtype)


def _metadata_type(dtype: pa.DataType) -> bool:
    return not _plain(dtype) or pa.types.is_struct(dtype)


COLUMN_TYPES = {  # kind -> (whether an Arrow type can hold it, what a row or column must be)
    "prompt": (_prompt_type, "a prompt is text or a non-empty list of {'role': ..., 'content': ...} chat messages"),
    "prompt_ids": (_ids_type, "'prompt_ids' is a non-empty list of token ids >= 0"),
    "tools": (_tools_type, "tools are a list of OpenAI function definitions (objects), or its JSON text"),
    "metadata": (_metadata_type, "'metadata' is an object"),
}


def _messages_ok(value: Any) -> bool:
    return (
        bool(value)
        and isinstance(value, list)
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in value)
    )


def _tools_ok(value: Any) -> bool:
    try:
        tools = json.loads(value) if isinstance(value, str) else value
    except ValueError:
        return False
    return isinstance(tools, list) and all(isinstance(tool, dict) for tool in tools)


def _metadata_ok(value: Any) -> bool:
    return isinstance(value, dict)
