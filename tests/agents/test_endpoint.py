"""The OpenAI-compatible endpoint driven by the real `openai` package: every call of an episode
lands in its own record, tool calls come back in OpenAI's schema, the record keeps the sampled
ids even where decoding and re-encoding the text gives other ids, a rewritten history forks a new
sequence, and finished or unknown episodes answer 404."""

from __future__ import annotations

import asyncio

import pytest

from moe_rl.agents import ChatFormat
from moe_rl.agents.tiny_tokenizer import lookup_call
from moe_rl.engine.process import EmbeddedConfig, launch_embedded
from moe_rl.tasks.lookup import KEY_CREDIT
from tests.agents import agents_for_tests
from tests.agents.conftest import CHAT_DIR, agent_config, rounds, save_chat_model
from tests.agents.test_episode_record import check_record, engine_calls_of

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

CHAT = ChatFormat.load(CHAT_DIR)
CALL_C = CHAT.encode(lookup_call("C"))[0]
LETTER_O = CHAT.encode("o")[0]


@pytest.fixture(scope="module")
def emitting_engines(tmp_path_factory):
    """Engines whose model emits one token every step: a whole lookup call, or "o"."""
    root = tmp_path_factory.mktemp("emitting")
    with (
        launch_embedded(EmbeddedConfig(model_path=save_chat_model(root / "call", emits=CALL_C), threads=1)) as calls,
        launch_embedded(EmbeddedConfig(model_path=save_chat_model(root / "o", emits=LETTER_O), threads=1)) as o,
    ):
        yield {"call": calls.url, "o": o.url}


def test_openai_sdk_agent_with_tool_calls(emitting_engines):
    (batch,), manager, pool = asyncio.run(rounds(agent_config("openai_tools"), emitting_engines["call"]))
    for sample in batch[0]:
        counts = check_record(sample, pool.calls)
        assert len(counts) == 3 and all(sampled == 2 for _, sampled in counts)
        assert sample.metadata["tool_calls"] == 6  # two calls a turn, parsed from the sampled text
        sampled = [t for t, m in zip(sample.response_ids, sample.loss_mask) if m]
        assert sampled == [CALL_C] * 6
        assert "<|im_start|>tool\n7<|im_end|>" in CHAT.tokenizer.decode(sample.response_ids)
    assert manager.agents.endpoint.calls == 6


def test_a_streamed_answer_is_the_whole_answer(emitting_engines):
    """`stream: true` gives the SDK the same turn as a plain call: the whole message (both tool
    calls), the finish reason and the usage, in chunks."""
    (batch,), _, pool = asyncio.run(rounds(agent_config("openai_streams"), emitting_engines["call"]))
    call_c = ("lookup", '{"key": "C"}')
    for sample in batch[0]:
        check_record(sample, pool.calls)
        streamed, plain = agents_for_tests.STREAMED[(sample.group_id, sample.metadata["episode"])]
        segments = model_segments(sample)
        assert streamed == (True, "", [call_c, call_c], "tool_calls", segments[0])
        assert plain == (False, "", [call_c, call_c], "tool_calls", segments[1])


@pytest.mark.parametrize("agent", ["lookup_agent", "lookup_openai_agent"])
def test_lookup_scores_an_episode_that_calls_again_without_the_call_credit(emitting_engines, agent):
    """The model calls `lookup` in its answering turn too: both lookup agents keep only the key
    credit (the call spells key C)."""
    config = agent_config(f"moe_rl.tasks.lookup:{agent}", groups_per_step=3, task_options={"num_keys": 3})
    (batch,), _, _ = asyncio.run(rounds(config, emitting_engines["call"]))
    samples = [sample for group in batch for sample in group]
    assert len(samples) == 6
    for sample in samples:
        assert sample.metadata["tool_calls"] == 4  # two calls a turn, two turns
        assert sample.reward == KEY_CREDIT * (sample.metadata["prompt"]["key"] == "C")


def test_sampled_ids_are_kept_where_text_would_retokenize_differently(emitting_engines):
    (batch,), _, pool = asyncio.run(rounds(agent_config("openai_tools"), emitting_engines["o"]))
    assert CHAT.encode("oo") != [LETTER_O, LETTER_O]  # "oo" is one token: re-tokenizing the reply would drift
    for sample in batch[0]:
        check_record(sample, pool.calls)
        sampled = [t for t, m in zip(sample.response_ids, sample.loss_mask) if m]
        assert sampled == [LETTER_O] * 6
        text = CHAT.tokenizer.decode(sample.prompt_ids + sample.response_ids)
        assert CHAT.encode(text) != sample.prompt_ids + sample.response_ids  # what re-tokenizing would train on


def test_rewritten_history_forks_a_new_sequence(chat_engine):
    (batch,), manager, pool = asyncio.run(rounds(agent_config("openai_rewrites_history"), chat_engine.url))
    samples = batch[0]
    assert len(samples) == 4  # two sequences per episode
    for episode in (0, 1):
        first, second = [s for s in samples if s.metadata["episode"] == episode]
        assert first.metadata["sequences"] == 2 and (first.metadata["sequence"], second.metadata["sequence"]) == (0, 1)
        assert first.reward == second.reward == float(episode)
        assert CHAT.tokenizer.decode(second.prompt_ids).startswith("<|im_start|>user\na shorter prompt")
        check_record(first, pool.calls), check_record(second, pool.calls)
    assert manager.metrics()["agents/forked_sequences"] == 2


def model_segments(sample) -> list[tuple[int, int]]:
    """(ids before it, length) of every run of sampled ids (loss mask 1) in the record."""
    segments, start = [], None
    for i, mask in enumerate([*sample.loss_mask, 0]):
        if mask and start is None:
            start = i
        elif not mask and start is not None:
            segments.append((len(sample.prompt_ids) + start, i - start))
            start = None
    return segments


def test_usage_of_each_call_agrees_with_the_record(chat_engine):
    """Three calls of 3, 1 and 2 tokens, after tool results or user turns: each call's usage counts
    the ids its engine request held and the ids it sampled, as the record and the engine saw them."""
    config = agent_config("openai_usage", groups_per_step=2)
    (batch,), _, pool = asyncio.run(rounds(config, chat_engine.url))
    for sample in [s for group in batch for s in group]:
        usage = agents_for_tests.USAGE[(sample.group_id, sample.metadata["episode"])]
        assert [(p, c) for p, c, _ in usage] == model_segments(sample)
        calls = engine_calls_of(sample, pool.calls)
        assert [(p, c) for p, c, _ in usage] == [(len(ids), len(result.output_ids)) for ids, _, result in calls]
        assert all(total == p + c for p, c, total in usage)
        assert usage[-1][2] == len(sample.prompt_ids) + len(sample.response_ids)


def test_unknown_finished_and_bad_requests(chat_engine):
    asyncio.run(rounds(agent_config("probes_the_endpoint"), chat_engine.url))
    assert agents_for_tests.PROBES == {
        "finished": 404,
        "unknown": 404,
        "n2": 400,
        "stream": 200,
        "required": 400,
        "stop": 400,
        "good": 200,
    }
