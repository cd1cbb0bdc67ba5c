"""Weight versions inside episodes and run checkpoints of open episodes, on a real engine.

- A turn cut by an abort-mode weight swap continues with the rest of its budget under the new
  weights: its per-token versions show the switch, the record stays token-exact.
- A run checkpoint taken while episodes are open keeps their finished turns: a new manager
  restored from it re-runs the agent, replays the recorded turns without the engine, and
  generates only the rest; no group is lost or duplicated."""

from __future__ import annotations

import asyncio
import json

import pytest

from moe_rl.rollout import RolloutManager
from tests.agents.conftest import CHAT_DIR, agent_config, save_chat_model
from tests.engine.engine_helpers import wait_until_decoding
from tests.rollout.rollout_helpers import cancel, make_pool, swap_weights

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)


def test_a_turn_cut_by_a_weight_swap_continues_under_the_new_version(chat_engine, tmp_path):
    other = save_chat_model(tmp_path / "v1", seed=1)
    config = agent_config("long_turns", groups_per_step=2, max_new_tokens=48, max_staleness=1)

    async def go():
        pool = make_pool(chat_engine.url, recording=True)
        manager = RolloutManager(config, pool, tokenizer_dir=CHAT_DIR)
        run = asyncio.create_task(manager.run())
        await wait_until_decoding(chat_engine.url, 4)
        await swap_weights(pool, other, version=1)
        await manager.buffer.set_version(1)
        batches = []
        for version in range(1, 5):  # until a cut turn's group is delivered (rounds 0 and 1 hold them)
            batches.append(await manager.buffer.get_batch(2))
            await manager.buffer.set_version(version + 1)
            if any(cut_turn(s) for g in batches[-1] for s in g):
                break
        await cancel(run)
        await pool.close()
        manager.close()
        return batches, pool.calls, manager

    batches, calls, manager = asyncio.run(go())
    samples = [s for batch in batches for group in batch for s in group]
    assert manager.continued_requests >= 1
    for sample in samples:  # (Sample itself checks that the routing rows cover every position)
        model = [v for v, m in zip(sample.weight_versions, sample.loss_mask) if m]
        assert model == sample.model_versions() and all(
            v is None for v, m in zip(sample.weight_versions, sample.loss_mask) if not m
        )
        versions = sample.model_versions()
        assert versions == sorted(versions) and set(versions) <= {0, 1, 2, 3, 4}
    assert any(cut_turn(s) for s in samples)  # a turn that ran under v0 and v1 (a swap between turns is not it)


def cut_turn(sample) -> bool:
    """A turn took two engine requests and its tokens carry versions 0 then 1."""
    return sample.segments > sample.metadata["turns"] and set(sample.model_versions()) >= {0, 1}


def test_open_episodes_resume_from_a_run_checkpoint(chat_engine):
    # a bound the test never reaches: restored groups are never dropped as stale, whatever the timing
    config = agent_config("long_turns", groups_per_step=2, max_new_tokens=48, max_staleness=10)

    async def snapshot_mid_episode():
        pool = make_pool(chat_engine.url)
        manager = RolloutManager(config, pool, tokenizer_dir=CHAT_DIR)
        run = asyncio.create_task(manager.run())
        while not any(len(e.log) == 1 for episodes in manager.agents.open.values() for e in episodes):
            await asyncio.sleep(0.002)
        state = json.loads(json.dumps(manager.snapshot()))  # what a run checkpoint writes
        await cancel(run)
        await pool.close()
        manager.close()
        return state

    async def resume(state):
        pool = make_pool(chat_engine.url, recording=True)
        manager = RolloutManager(config, pool, tokenizer_dir=CHAT_DIR)
        manager.restore(state)
        run = asyncio.create_task(manager.run())
        restored, batch = {group["group_id"] for group in state["open"]}, []
        for _ in range(10):
            batch += await manager.buffer.get_batch(2)  # until every restored group is trained or dropped
            if restored <= set(manager.buffer.delivered) | set(manager.buffer.dropped):
                break
            await manager.buffer.set_version(manager.buffer.version + 1)
        await cancel(run)
        await pool.close()
        manager.close()
        return batch, pool.calls, manager

    state = asyncio.run(snapshot_mid_episode())
    recorded = {
        (group["group_id"], i): log[0]["sample"]
        for group in state["open"]
        for i, log in enumerate(group["episodes"])
        if log
    }
    assert recorded
    batch, calls, manager = asyncio.run(resume(state))
    assert manager.metrics()["agents/replayed_turns_per_episode"] > 0
    for sample in (s for group in batch for s in group):
        first_turn = recorded.get((sample.group_id, sample.metadata["episode"]))
        if first_turn is None:
            continue
        done = first_turn["prompt_ids"] + first_turn["response_ids"]
        assert (sample.prompt_ids + sample.response_ids)[: len(done)] == done  # the finished turn is kept
        assert sample.weight_versions[: len(first_turn["weight_versions"])] == first_turn["weight_versions"]
    opened = {group["group_id"] for group in state["open"]}
    accounting = manager.accounting()
    assert opened <= manager.started_ids and accounting["started"] == len(manager.started_ids)
