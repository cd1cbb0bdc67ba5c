"""The episode record on a real embedded engine: one token sequence per trajectory equal to the
prompt + the sampled ids + the environment ids, exactly as the engine saw them; loss mask 1 on
sampled tokens and 0 on environment tokens; versions and logprobs on sampled tokens only; routed
experts for every position, each row asked of the engine once (`routed_experts_start_len`)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from moe_rl.agents import ChatFormat
from moe_rl.sample import Sample
from tests.agents.conftest import CHAT_DIR, agent_config, rounds

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)


def engine_calls_of(sample: Sample, calls) -> list:
    """The engine requests behind `sample`, in order: each one's input extends the record so far
    and its output continues the sample (episodes with equal turns may send equal requests)."""
    ids, record, mine = sample.prompt_ids + sample.response_ids, [], []
    for call in calls:
        input_ids, _, result = call
        whole = input_ids + result.output_ids
        if input_ids[: len(record)] == record and len(whole) > len(record) and ids[: len(whole)] == whole:
            mine.append(call)
            record = whole
    return mine


def check_record(sample: Sample, calls) -> list[tuple[int, int]]:
    """Asserts the record contract against the engine calls; returns each turn's (env, sampled) counts."""
    mine = engine_calls_of(sample, calls)
    assert mine and mine[0][0] == sample.prompt_ids
    record, routed, counts = list(sample.prompt_ids), [], []
    mask, logprobs, versions = [], [], []
    for input_ids, kwargs, result in mine:
        assert input_ids[: len(record)] == record  # the record is reused, never re-tokenized
        env = input_ids[len(record) :]
        assert kwargs["routed_experts_start_len"] == (len(record) - 1 if len(record) > len(sample.prompt_ids) else 0)
        record += env + result.output_ids
        routed.append(result.routed_experts)
        mask += [0] * len(env) + [1] * len(result.output_ids)
        logprobs += [0.0] * len(env) + result.logprobs
        versions += [None] * len(env) + result.weight_versions
        counts.append((len(env), len(result.output_ids)))
    assert sample.prompt_ids + sample.response_ids == record
    assert sample.loss_mask == mask and sample.rollout_logprobs == logprobs and sample.weight_versions == versions
    rows = np.concatenate(routed)
    assert rows.shape[0] == len(record) - 1 and np.array_equal(sample.routed_experts, rows)
    return counts


def test_agent_function_episodes_are_token_exact(chat_engine):
    config = agent_config("three_turns", groups_per_step=2)
    (batch,), manager, pool = asyncio.run(rounds(config, chat_engine.url))
    chat = ChatFormat.load(CHAT_DIR)
    samples = [s for group in batch for s in group]
    assert len(samples) == 4
    for sample in samples:
        counts = check_record(sample, pool.calls)
        assert len(counts) == 3 and all(env > 0 for env, _ in counts[1:])
        assert sample.metadata["turns"] == 3 and sample.status == "completed"
        text = chat.tokenizer.decode(sample.response_ids)
        assert "<|im_start|>tool\nvalue 7<|im_end|>" in text and "<|im_start|>user\nand now?<|im_end|>" in text
        assert text.endswith(chat.tokenizer.decode(sample.response_ids[-counts[-1][1] :]))
        assert sample == Sample.from_dict(sample.to_dict())  # round-trips, None versions included
    metrics = manager.metrics()
    assert metrics["agents/turns_per_episode"] == 3 and metrics["agents/episodes"] >= 4


def test_token_level_environment(chat_engine):
    (batch,), _, pool = asyncio.run(rounds(agent_config("in_tokens"), chat_engine.url))
    for sample in batch[0]:
        (env0, n0), (env1, n1) = check_record(sample, pool.calls)
        first = len(sample.prompt_ids) + n0
        assert env1 == 3 and (sample.prompt_ids + sample.response_ids)[first : first + 3] == [40, 41, 42]
