"""A Parquet dataset of chat prompts with tools (verl's layout, few-shot tool calls in the prompt)
drives agent episodes on a real engine: each episode starts from its row's messages and tools as
the chat template renders them, keeps the row's metadata, and stays one token-exact sequence."""

from __future__ import annotations

import asyncio

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moe_rl.agents import ChatFormat
from tests.agents.conftest import CHAT_DIR, agent_config, rounds
from tests.agents.test_episode_record import check_record
from tests.rollout.test_datasets import TOOLS, chat_rows, dataset_cache  # noqa: F401  (the fixture: HF cache in tmp)

pytestmark = pytest.mark.world  # starts an engine (tests/conftest.py)

CHAT = ChatFormat.load(CHAT_DIR)


def test_parquet_chat_rows_with_tools_drive_agent_episodes(chat_engine, tmp_path):
    rows = chat_rows()
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "agent.parquet")
    config = agent_config("three_turns", task="dataset", dataset=str(tmp_path / "agent.parquet"), groups_per_step=2)
    (batch,), manager, pool = asyncio.run(rounds(config, chat_engine.url))
    rendered = {}
    for row in rows:
        messages = [{k: v for k, v in m.items() if v is not None} for m in row["prompt"]]
        rendered[tuple(CHAT.prompt_ids(messages, TOOLS))] = row
    samples = [s for group in batch for s in group]
    assert len(samples) == 4
    for sample in samples:
        row = rendered[tuple(sample.prompt_ids)]  # the row's messages, tool call and result, and tools
        assert sample.metadata["prompt"] == row["metadata"] and sample.metadata["answer"] == row["answer"]
        assert sample.metadata["tools"] == TOOLS and sample.metadata["messages"][0] == row["prompt"][0]
        counts = check_record(sample, pool.calls)  # every turn extends the record, routing for every position
        assert len(counts) == 3 and sample.metadata["sequences"] == 1
    assert manager.metrics()["agents/forked_sequences"] == 0
