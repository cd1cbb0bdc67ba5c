"""Evaluation of an agent dataset: episodes through the agent on a real embedded engine, pass@k over
episodes, turns and tool calls per episode, the agent's own metrics, and records that carry each episode's turns."""

from __future__ import annotations

import asyncio

import pytest

from moe_rl.rollout.eval_config import EvalConfig, EvalDatasetConfig
from moe_rl.rollout.evaluation import Evaluator
from tests.agents.conftest import AGENTS, CHAT_DIR, agent_config
from tests.rollout.rollout_helpers import make_pool

pytestmark = pytest.mark.world  # starts an embedded engine (tests/conftest.py)


def test_an_agent_eval_runs_episodes_and_reports_turns(chat_engine):
    prompts, n = 2, 2
    config = EvalConfig(
        datasets=[
            EvalDatasetConfig(
                name="lookup", task="lookup", num_prompts=prompts, n_samples_per_prompt=n, agent=f"{AGENTS}:three_turns"
            )
        ]
    )

    async def scenario():
        pool = make_pool(chat_engine.url)
        evaluator = Evaluator(config, agent_config("three_turns"), pool, str(CHAT_DIR))
        await evaluator.start()
        try:
            return (await evaluator.evaluate(step=0))[0]
        finally:
            await evaluator.close()
            await pool.close()

    result = asyncio.run(scenario())
    metrics = result.metrics
    assert metrics["eval/lookup/episodes"] == prompts * n
    assert metrics["eval/lookup/turns_per_episode"] == 3
    assert "eval/lookup/pass@2" in metrics and "eval/lookup/tool_calls_per_episode" in metrics
    assert metrics["eval/lookup/metric/first"] == 1 / n  # the agent's own metric: one first episode of n
    episodes = {(r["group_id"], r["episode"]["index"]) for r in result.records}
    assert len(episodes) == prompts * n
    for record in result.records:
        assert record["episode"]["turns"] == 3 and isinstance(record["episode"]["calls"], list)
        assert len({v for _, _, v in record["versions"] if v is not None}) == 1
    # three_turns returns the last turn's length + the episode index: rewards >= 1 only for episode 1 or more
    rewards = sorted(r["reward"] for r in result.records)
    assert metrics["eval/lookup/reward_mean"] == pytest.approx(sum(rewards) / len(rewards))
