"""How episodes end: an agent that raises, hangs or returns garbage drops its group with the
reason in the ledger while the round goes on with fresh prompts; a limit ends an episode
truncated with its tokens kept; a run whose every episode fails stops with the agent's error."""

from __future__ import annotations

import asyncio

import pytest

from moe_rl.agents import EpisodeConfig
from tests.agents.conftest import agent_config, rounds
from tests.agents.test_episode_record import check_record

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)


def test_failing_agents_drop_their_groups_and_the_round_goes_on(chat_engine):
    config = agent_config("fails_by_group", groups_per_step=2, episode=EpisodeConfig(timeout_s=2.0))
    (batch,), manager, _ = asyncio.run(rounds(config, chat_engine.url))
    assert len(batch) == 2 and all(int(g[0].group_id.rsplit("-", 1)[1]) > 2 for g in batch)
    dropped = manager.buffer.dropped
    assert dropped["g0-0"] == "agent_error" and dropped["g0-1"] == "agent_timeout"
    assert dropped["g0-2"] == "agent_error"
    metrics = manager.metrics()
    assert metrics["agents/dropped_agent_error"] == 2 and metrics["agents/dropped_agent_timeout"] == 1
    assert any("the tool server is down" in failure for failure in manager.agents.failures)
    assert any("not a reward" in failure for failure in manager.agents.failures)


def test_agent_metrics_are_logged_as_means_over_episodes(chat_engine):
    """`episode.metrics`: per step the mean of each over the finished episodes, in each sample's
    metadata (the dumps' `episode.metrics`); a value that is not a finite number drops the group."""
    (batch,), manager, _ = asyncio.run(rounds(agent_config("with_metrics", groups_per_step=2), chat_engine.url))
    assert manager.buffer.dropped["g0-0"] == "agent_error"
    assert any("metrics['index'] = nan" in failure for failure in manager.agents.failures)
    for group in batch:
        assert [s.metadata["metrics"] for s in group] == [{"index": 0.0, "first": 1.0}, {"index": 1.0, "first": 0.0}]
    metrics = manager.metrics()  # two episodes a group: index 0 and 1, one first
    assert metrics["agents/metric/index"] == 0.5 and metrics["agents/metric/first"] == 0.5
    assert "agents/metric/index" not in manager.metrics()  # no episode finished since


def test_every_episode_failing_stops_the_run(chat_engine):
    with pytest.raises(RuntimeError, match="every agent episode failed.*broken agent"):
        asyncio.run(rounds(agent_config("always_raises", groups_per_step=2), chat_engine.url))


@pytest.mark.parametrize("limit", ["max_context_tokens", "max_turns"])
def test_limits_end_episodes_truncated_with_their_tokens(chat_engine, limit):
    episode = EpisodeConfig(max_context_tokens=80) if limit == "max_context_tokens" else EpisodeConfig(max_turns=3)
    (batch,), manager, pool = asyncio.run(rounds(agent_config("until_limit", episode=episode), chat_engine.url))
    for sample in batch[0]:
        counts = check_record(sample, pool.calls)
        assert sample.status == "truncated" and sample.reward is not None
        if limit == "max_turns":
            assert len(counts) == sample.metadata["turns"] == 3
        else:
            assert len(sample.prompt_ids) + len(sample.response_ids) <= 80
    assert manager.metrics()["agents/truncated_episodes"] == 2
