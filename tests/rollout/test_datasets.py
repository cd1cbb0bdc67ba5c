"""The "dataset" task: JSONL, Parquet (verl's layout), directories and `save_to_disk` datasets read
with HF `datasets`; key mapping (dotted answer keys, tools, metadata); every error names the file,
the row and the key; each epoch a seeded shuffle of all rows; no per-row Python objects kept."""

from __future__ import annotations

import gc
import itertools
import json
import re
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from moe_rl.agents.chat import ChatFormat
from moe_rl.rollout import RolloutConfig
from moe_rl.tasks import make_task
from moe_rl.tasks.dataset import open_dataset

CHAT_DIR = Path(__file__).resolve().parents[2] / "configs" / "tokenizers" / "tiny_chat"
CHAT = ChatFormat.load(CHAT_DIR)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "the value of a key",
            "parameters": {"type": "object", "properties": {"key": {"type": "string"}}},
        },
    }
]


@pytest.fixture(autouse=True)
def dataset_cache(tmp_path, monkeypatch):
    """`load_dataset`'s Arrow conversions go under tmp_path, not the user's HF cache."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


def verl_rows(n: int) -> list[dict]:
    return [
        {
            "data_source": "gsm8k",
            "prompt": [{"role": "user", "content": f"{i}+1?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(n)
    ]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def dataset(path, **keys):
    return make_task("dataset", path=path, tokenizer_dir=CHAT_DIR, **keys)


def test_verl_parquet_trains_with_a_dotted_answer_key(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(verl_rows(3)), path)
    config = RolloutConfig(task="dataset", dataset=str(path), answer_key="reward_model.ground_truth")
    task = config.make_task(str(CHAT_DIR))
    assert len(task) == 3
    prompt = task.prompt(2)
    assert prompt.messages == [{"role": "user", "content": "2+1?"}] and prompt.tools is None
    assert prompt.prompt_ids == CHAT.prompt_ids(prompt.messages) and prompt.answer == "3"
    # metadata_keys=None: verl's columns
    assert prompt.metadata == {"data_source": "gsm8k", "ability": "math", "extra_info": {"split": "train", "index": 2}}


def test_jsonl_text_ids_tools_and_metadata(tmp_path):
    rows = [
        {"prompt": "what", "answer": "4", "metadata": {"source": "t"}, "tools": TOOLS},
        {"prompt_ids": [5, 6, 7], "answer": "5", "metadata": {"source": "u"}},
    ]
    task = dataset(write_jsonl(tmp_path / "data.jsonl", rows), apply_chat_template=True)
    text, ids = task.prompt(0), task.prompt(1)
    assert text.tools == TOOLS and text.messages == [{"role": "user", "content": "what"}]
    rendered = CHAT.tokenizer.decode(text.prompt_ids)
    assert rendered.startswith(
        "<|im_start|>system\ntools: lookup<|im_end|>\n<|im_start|>user\nwhat"
    )  # the template saw the tools
    assert text.metadata == {"source": "t"} and ids.metadata == {"source": "u"}
    assert ids.prompt_ids == [5, 6, 7] and ids.messages is None and ids.tools is None


def test_slime_style_keys_and_json_text_tools(tmp_path):
    rows = [
        {"input": [{"role": "user", "content": "key A"}], "label": 7, "tool_list": json.dumps(TOOLS), "level": 1},
        {"input": [{"role": "user", "content": "key B"}], "label": 8, "tool_list": None, "level": 2},
    ]
    keys = dict(prompt_key="input", answer_key="label", tools_key="tool_list", metadata_keys=["level"])
    task = dataset(write_jsonl(tmp_path / "slime.jsonl", rows), **keys)
    first, second = task.prompt(0), task.prompt(1)
    assert first.tools == TOOLS and first.prompt_ids == CHAT.prompt_ids(rows[0]["input"], TOOLS)
    assert second.tools is None and second.prompt_ids == CHAT.prompt_ids(rows[1]["input"])
    assert (first.answer, first.metadata, second.metadata) == (7, {"level": 1}, {"level": 2})


def test_save_to_disk_and_a_directory_of_parquet_files(tmp_path):
    rows = verl_rows(5)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    saved = dataset(tmp_path / "saved", answer_key="reward_model.ground_truth", metadata_keys=[])
    assert len(saved) == 5 and saved.prompt(4).answer == "5" and saved.prompt(4).metadata == {}
    (tmp_path / "shards").mkdir()
    for i, part in enumerate((rows[:2], rows[2:])):
        pq.write_table(pa.Table.from_pylist(part), tmp_path / "shards" / f"part-{i}.parquet")
    shards = dataset(tmp_path / "shards", answer_key="reward_model.ground_truth")
    assert len(shards) == 5 and sorted(shards.prompt(i).answer for i in range(5)) == ["1", "2", "3", "4", "5"]


def test_each_epoch_is_a_seeded_shuffle_of_every_row(tmp_path):
    rows = [{"prompt_ids": [i + 1], "answer": i} for i in range(7)]
    task = make_task("dataset", path=write_jsonl(tmp_path / "ids.jsonl", rows))
    drawn = [p.answer for p in itertools.islice(task.prompts(3), 3 * len(task))]
    epochs = [drawn[i : i + 7] for i in range(0, 21, 7)]
    assert all(sorted(epoch) == list(range(7)) for epoch in epochs)
    assert len({tuple(epoch) for epoch in epochs}) > 1  # reshuffled per epoch
    assert drawn == [p.answer for p in itertools.islice(task.prompts(3), 21)]
    assert drawn != [p.answer for p in itertools.islice(task.prompts(4), 21)]


def error_cases(tmp_path: Path) -> list[tuple[Path, dict, str]]:
    verl = verl_rows(20)
    verl[17]["reward_model"]["ground_truth"] = None
    pq.write_table(pa.Table.from_pylist(verl), tmp_path / "x.parquet")
    write_jsonl(tmp_path / "bad_ids.jsonl", [{"prompt_ids": [1], "answer": 1}, {"prompt_ids": [2, -1], "answer": 1}])
    write_jsonl(tmp_path / "both.jsonl", [{"prompt": "a", "prompt_ids": [1], "answer": 1}])
    write_jsonl(
        tmp_path / "empty_chat.jsonl",
        [{"prompt": [{"role": "user", "content": "a"}], "answer": 1}, {"prompt": [], "answer": 1}],
    )
    (tmp_path / "broken.jsonl").write_text('{"prompt": "a", "answer": 1}\n{"prompt": \n')
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "data.csv").write_text("prompt,answer\na,1\n")
    (tmp_path / "nothing").mkdir()
    write_jsonl(tmp_path / "meta.jsonl", [{"prompt": "a", "answer": 1, "metadata": "not an object"}])
    write_jsonl(tmp_path / "tools.jsonl", [{"prompt": "a", "answer": 1, "tools": "{not json"}])
    dotted = dict(answer_key="reward_model.ground_truth")
    return [
        (tmp_path / "missing.jsonl", {}, "missing.jsonl': no such file or directory"),
        (tmp_path / "data.csv", {}, "data.csv': unsupported file type '.csv'"),
        (tmp_path / "nothing", {}, "nothing': no .jsonl, .json or .parquet files"),
        (tmp_path / "empty.jsonl", {}, "empty.jsonl': .*no rows"),
        (tmp_path / "broken.jsonl", {}, "broken.jsonl' line 2 is not JSON (Expecting value): fix or remove it"),
        (tmp_path / "x.parquet", dotted, "x.parquet' row 17: no 'reward_model.ground_truth' (rollout.answer_key)"),
        (
            tmp_path / "x.parquet",
            dict(answer_key="reward_model.truth"),
            "x.parquet': no column 'reward_model.truth' (rollout.answer_key); the file has columns "
            "['data_source', 'prompt', 'ability', 'reward_model.style', 'reward_model.ground_truth', ",
        ),
        (
            tmp_path / "x.parquet",
            dict(dotted, prompt_key="question"),
            "x.parquet': no column 'question' (rollout.prompt_key)",
        ),
        (tmp_path / "x.parquet", dict(dotted, metadata_keys=["level"]), "no column 'level' (rollout.metadata_keys)"),
        (tmp_path / "bad_ids.jsonl", {}, "bad_ids.jsonl' row 1: 'prompt_ids' is a non-empty list of token ids >= 0"),
        (
            tmp_path / "both.jsonl",
            {},
            "both.jsonl' row 0: give either 'prompt' (rollout.prompt_key) or 'prompt_ids', not both",
        ),
        (
            tmp_path / "empty_chat.jsonl",
            {},
            "empty_chat.jsonl' row 1: 'prompt' (rollout.prompt_key) is an empty list: a prompt is text or a non-empty",
        ),
        (tmp_path / "meta.jsonl", {}, "meta.jsonl': column 'metadata' is string: 'metadata' is an object"),
        (
            tmp_path / "tools.jsonl",
            {},
            "tools.jsonl' row 0: 'tools' (rollout.tools_key) is not valid JSON (",
        ),
    ]


def test_errors_name_the_file_the_row_and_the_key(tmp_path):
    for path, keys, message in error_cases(tmp_path):
        with pytest.raises(ValueError, match=re.escape(message) if "*" not in message else message):
            dataset(path, **keys)
    with pytest.raises(ValueError, match="rollout.dataset goes with rollout.task='dataset'"):
        RolloutConfig(task="dataset")
    with pytest.raises(ValueError, match="rollout.task='dataset' needs rollout.dataset"):
        make_task("dataset")


def test_a_line_that_is_not_json_is_named_by_its_line_number_in_one_line(tmp_path, capfd):
    """pyarrow counts rows from 0 within a read block and skips blank lines, and `datasets` logs its
    own line first: the refusal names the file's line, counted from 1, and nothing else is printed."""
    good = json.dumps({"prompt": "1+1?", "answer": "2"})
    lines = tmp_path / "rows.jsonl"
    lines.write_text(f"{good}\n\nnot json\n{good}\n")
    with pytest.raises(ValueError, match=r"rows.jsonl' line 3 is not JSON \(Expecting value\): fix or remove it$"):
        open_dataset(lines)
    array = tmp_path / "rows.json"
    array.write_text(f"[\n  {good},\n  {good.replace(', ', ' ')}\n]\n")
    with pytest.raises(ValueError, match=r"rows.json' line 3 is not JSON \(Expecting ',' delimiter\)"):
        open_dataset(array)
    directory = tmp_path / "parts"
    directory.mkdir()
    write_jsonl(directory / "a.jsonl", [{"prompt": "1+1?", "answer": "2"}] * 2)  # good JSON lines
    (directory / "b.jsonl").write_text(f"{good}\n{good}}}\n")
    with pytest.raises(ValueError, match=r"parts' file b.jsonl line 2 is not JSON \(Extra data\)"):
        open_dataset(directory)
    captured = capfd.readouterr()
    assert captured.out == captured.err == ""


def rss_anon_bytes() -> int:
    """Anonymous resident memory (heap: Python objects, Arrow buffers). A memory-mapped Arrow file
    counts as file-backed (RssFile), so only what the task builds itself shows here."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    pytest.skip("no /proc/self/status RssAnon (not Linux)")


def test_a_large_parquet_is_memory_mapped_not_materialised(tmp_path):
    """200k rows of ~200-character prompts: ~40 MB of text; as Python rows (a dict, a str, an answer
    and a metadata dict each) they take ~150 MB of heap (measured with `task.data.to_list()`).
    Building the task (the up-front check of every row included) and drawing 1000 prompts must stay
    under 24 MB of anonymous memory, and no attribute of the task may be a row list. The one-time
    conversion to the cached Arrow file runs first: it holds a Parquet row group at a time, a cost
    of the file's layout, not of the task."""
    n = 200_000
    index = pa.array(np.arange(n)).cast(pa.string())
    text = pc.binary_join_element_wise("what is ", index, " plus one? " + "x" * 180, "")  # no Python rows here
    metadata = pa.array([{"i": 0}]).take(np.zeros(n, int))
    pq.write_table(pa.table({"prompt": text, "answer": index, "metadata": metadata}), tmp_path / "large.parquet")
    del text, index, metadata
    open_dataset(tmp_path / "large.parquet")  # the conversion, cached
    gc.collect()
    before = rss_anon_bytes()
    task = make_task("dataset", path=tmp_path / "large.parquet", tokenizer_dir=CHAT_DIR)
    drawn = list(itertools.islice(task.prompts(0), 1000))
    grown = rss_anon_bytes() - before
    print(f"RssAnon growth, {n} rows: {grown / 2**20:.1f} MiB")
    assert len(task) == n and len({p.answer for p in drawn}) == 1000
    assert grown < 24 * 2**20, f"{grown / 2**20:.1f} MiB"
    assert task.data.cache_files  # served from an Arrow file on disk, memory-mapped
    assert not any(isinstance(v, (list, tuple, dict)) and len(v) >= n for v in vars(task).values())


def chat_rows() -> list[dict]:
    """Rows for agents: a system turn, a few-shot assistant tool call (content null) and its result."""
    call = {"id": "c0", "type": "function", "function": {"name": "lookup", "arguments": '{"key": "A"}'}}
    return [
        {
            "prompt": [
                {"role": "system", "content": f"row {i}"},
                {"role": "user", "content": "key A"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": str(i), "tool_call_id": "c0"},
                {"role": "user", "content": f"key {'BC'[i % 2]}"},
            ],
            "tools": TOOLS,
            "answer": str(i),
            "metadata": {"key": "BC"[i % 2]},
        }
        for i in range(4)
    ]


def write_each_format(tmp_path: Path, rows: list[dict]) -> list[Path]:
    """The same rows as JSONL, a JSON array, Parquet, a directory of Parquet files, save_to_disk."""
    paths = [write_jsonl(tmp_path / "rows.jsonl", rows), tmp_path / "rows.json", tmp_path / "rows.parquet"]
    paths[1].write_text(json.dumps(rows))
    pq.write_table(pa.Table.from_pylist(rows), paths[2])
    (tmp_path / "shards").mkdir()
    for i in range(2):
        pq.write_table(pa.Table.from_pylist(rows[2 * i : 2 * i + 2]), tmp_path / "shards" / f"part-{i}.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    return [*paths, tmp_path / "shards", tmp_path / "saved"]


def test_chat_rows_give_agents_messages_tools_and_metadata_in_every_format(tmp_path):
    rows = chat_rows()
    for path in write_each_format(tmp_path, rows):
        task = dataset(path, for_agents=True)
        prompts = sorted((task.prompt(i) for i in range(len(task))), key=lambda p: p.answer)
        for row, prompt in zip(rows, prompts):
            expected = [{k: v for k, v in m.items() if v is not None} for m in row["prompt"]]
            assert prompt.messages == expected, path
            assert prompt.tools == TOOLS and prompt.metadata == row["metadata"] and prompt.answer == row["answer"]
            assert prompt.prompt_ids == []  # each episode renders them with its chat format
        # without an agent the same rows are rendered here, tool call and tool result included
        single = dataset(path).prompt(0)
        text = CHAT.tokenizer.decode(single.prompt_ids)
        assert '<tool_call>\n{"name": "lookup", "arguments": {"key": "A"}}\n</tool_call>' in text
        assert single.prompt_ids == CHAT.prompt_ids(single.messages, TOOLS)


def test_chat_messages_and_tools_are_checked_row_by_row(tmp_path):
    """Arrow-typed columns (JSONL, Parquet) and JSON-typed ones (a JSONL column mixing text and lists)
    alike: the error names the file, the row, the key and what is wrong."""
    good = {"prompt": [{"role": "user", "content": "a"}], "answer": "1"}
    tool = TOOLS[0]
    cases = [
        ({"prompt": [{"content": "b"}]}, "'prompt' (rollout.prompt_key) message 0 has no 'role'"),
        ({"prompt": [{"role": "user", "content": None}]}, "'prompt' (rollout.prompt_key) message 0 (user) has no"),
        (
            {"prompt": [{"role": "user", "content": "b"}, {"role": "assistant", "content": None}]},
            "message 1 (assistant)",
        ),
        ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools[0] has no function name"),
        ({"tools": [tool, {**tool, "type": "retrieval"}]}, "tools[1] has type 'retrieval', not 'function'"),
    ]
    for i, (change, message) in enumerate(cases):
        rows = [dict(good, tools=TOOLS), {**good, "tools": TOOLS, **change}]
        jsonl = write_jsonl(tmp_path / f"case{i}.jsonl", rows)
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / f"case{i}.parquet")
        for path in (jsonl, tmp_path / f"case{i}.parquet"):
            with pytest.raises(ValueError, match=re.escape(f"{path.name}' row 1: ") + ".*" + re.escape(message)):
                dataset(path)
    mixed = write_jsonl(
        tmp_path / "mixed.jsonl", [{"prompt": "text", "answer": 1}, {"prompt": [{"role": "u"}], "answer": 1}]
    )
    with pytest.raises(
        ValueError, match=re.escape("mixed.jsonl' row 1: 'prompt' (rollout.prompt_key) message 0 (u) has no")
    ):
        dataset(mixed)
    text_tools = '[{"type": "function", "function": {"name": "f", "parameters": "x"}}]'
    bad_params = write_jsonl(tmp_path / "params.jsonl", [{**good, "tools": text_tools}])
    with pytest.raises(ValueError, match=re.escape("row 0: 'tools' (rollout.tools_key) tools[0] has parameters that")):
        dataset(bad_params)


def test_agents_refuse_rows_without_chat_messages(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "a"}], "answer": 1}, {"prompt": "plain text", "answer": 2}]
    path = write_jsonl(tmp_path / "text.jsonl", rows)
    with pytest.raises(
        ValueError,
        match=re.escape("text.jsonl' row 1: 'prompt' (rollout.prompt_key) is text: rollout.agent needs chat"),
    ):
        dataset(path, for_agents=True)
    as_user = dataset(path, for_agents=True, apply_chat_template=True).prompt(1)  # the text as one user turn
    assert as_user.messages == [{"role": "user", "content": "plain text"}] and as_user.prompt_ids == []
    ids = write_jsonl(tmp_path / "ids.jsonl", [{"prompt_ids": [5, 6], "answer": 1}])
    with pytest.raises(ValueError, match=re.escape("ids.jsonl' row 0: 'prompt_ids' are token ids, and rollout.agent")):
        dataset(ids, for_agents=True)
