"""Weight versions inside episodes and run checkpoints of open episodes, on a real engine.

- A turn cut by an abort-mode weight swap continues with the rest of its budget under the new
  weights: its per-token versions show the switch, the record stays token-exact.
- A run checkpoint taken while episodes are open keeps their finished turns: a new manager
  restored from it re-runs the agent, replays the recorded turns without the engine, and
  generates only the rest; no group is lost or duplicated."""

from __future__ import annotations

import asyncio
import json

from moe_rl.rollout import RolloutManager
from tests.agents.conftest import CHAT_DIR, agent_config, save_chat_model
from tests.agents.test_episode_record import check_record, engine_calls_of
from tests.engine.engine_helpers import wait_until_decoding
from tests.rollout.rollout_helpers import cancel, make_pool, swap_weights


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
        batches = [await manager.buffer.get_batch(2), await manager.buffer.get_batch(2)]
        await cancel(run)
        await pool.close()
        manager.close()
        return batches, pool.calls, manager

    batches, calls, manager = asyncio.run(go())
    samples = [s for batch in batches for group in batch for s in group]
    assert manager.continued_requests >= 1
    switched = 0
    for sample in samples:
        check_record(sample, calls)
        versions = sample.model_versions()
        assert versions == sorted(versions) and set(versions) <= {0, 1}
        if set(versions) == {0, 1}:
            switched += 1
            assert sample.metadata["num_segments"] > sample.metadata["turns"]  # a turn took two requests
    assert switched >= 1


def test_open_episodes_resume_from_a_run_checkpoint(chat_engine):
    config = agent_config("long_turns", groups_per_step=2, max_new_tokens=48)

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
        batch = await manager.buffer.get_batch(2)
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
    replayed = 0
    for sample in (s for group in batch for s in group):
        first_turn = recorded.get((sample.group_id, sample.metadata["episode"]))
        if first_turn is None:
            continue
        done = first_turn["prompt_ids"] + first_turn["response_ids"]
        assert (sample.prompt_ids + sample.response_ids)[: len(done)] == done  # the finished turn is kept
        assert sample.weight_versions[: len(first_turn["weight_versions"])] == first_turn["weight_versions"]
        mine = engine_calls_of(sample, calls)
        assert len(mine[0][0]) > len(done) - 1  # the engine was not asked for the replayed turn again
        replayed += 1
    assert replayed >= 1
    opened = {group["group_id"] for group in state["open"]}
    accounting = manager.accounting()
    assert opened <= manager.started_ids and accounting["started"] == len(manager.started_ids)
