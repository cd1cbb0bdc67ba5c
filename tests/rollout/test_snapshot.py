"""Run-checkpoint state of the rollout manager: a snapshot taken while groups are mid-generation
(some samples cut by an abort-mode weight swap), JSON round-tripped like `rollout.json`, restored
into a fresh manager that continues every partial sample from its tokens on a real engine."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from moe_rl.rollout import RolloutConfig, RolloutManager
from moe_rl.rollout.manager import is_finished
from moe_rl.sample import Sample
from tests.engine.engine_helpers import wait_until_decoding
from tests.rollout.rollout_helpers import cancel, make_pool, swap_weights

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

CONFIG = RolloutConfig(
    groups_per_step=2, n_samples_per_prompt=4, max_new_tokens=600, max_staleness=0, task_options={"length": 3}
)


def has_partial_tokens(state: dict) -> bool:
    return any(s["response_ids"] and s["status"] == "aborted" for g in state["open"] for s in g["samples"])


async def interrupted_run(pool, model_dirs) -> tuple[dict, int]:
    """Generate one round, swapping weights (abort mode) once requests are decoding, until a
    snapshot holds a sample cut mid-response (600 tokens each: the first swap comes mid-generation);
    returns that snapshot (as JSON would) and the version reached."""
    manager = RolloutManager(CONFIG, pool, version=0)
    run = asyncio.create_task(manager.run(num_rounds=1))
    version = 0
    for _ in range(50):
        # first the round's 8 samples, then (after a swap) at least one resumed: past a prefill, decoding
        await wait_until_decoding(pool.clients[0].url, 8 if version == 0 else 1)
        version += 1
        await swap_weights(pool, model_dirs[version % 2], version)
        await manager.buffer.set_version(version)
        state = json.loads(json.dumps(manager.snapshot()))
        if has_partial_tokens(state):
            break
    await cancel(run)
    manager.close()
    return state, version


def test_snapshot_restore_continues_partial_samples_from_their_tokens(engine, model_dirs):
    async def go():
        pool = make_pool(engine.url)
        state, version = await interrupted_run(pool, model_dirs)
        resumed = RolloutManager(CONFIG, pool, version=version)
        resumed.restore(state)
        run = asyncio.create_task(resumed.run())
        restored = restored_ids(state)
        while not restored <= resumed.buffer.queued_ids():
            await asyncio.sleep(0.05)
        await cancel(run)
        await pool.close()
        resumed.close()
        return state, version, resumed

    state, version, resumed = asyncio.run(go())
    assert has_partial_tokens(state), "no sample was cut mid-response: raise max_new_tokens"
    queued = {g[0]["group_id"]: g for g in resumed.buffer.snapshot()["queued"]}
    for group in state["open"]:
        for before, after in zip(group["samples"], queued[group["group_id"]]):
            before, after = Sample.from_dict(before), Sample.from_dict(after)
            n = len(before.response_ids)
            if is_finished(before):  # finished before the checkpoint: kept, not regenerated
                assert after.response_ids == before.response_ids and after.request_ids == before.request_ids
                continue
            # a partial one goes on exactly where it stopped, in one more segment, under `version`
            assert after.response_ids[:n] == before.response_ids
            assert after.rollout_logprobs[:n] == before.rollout_logprobs
            assert after.weight_versions[:n] == before.weight_versions
            assert set(after.weight_versions[n:]) == {version}
            assert len(after.response_ids) == CONFIG.max_new_tokens or after.status == "completed"
            assert after.segments == before.segments + 1
            if n:
                assert np.array_equal(after.routed_experts[: before.routed_experts.shape[0]], before.routed_experts)
            assert after.routed_experts.shape[0] == len(after.prompt_ids) + len(after.response_ids) - 1
    # the ledger and the data position carry over: no group id is reused, none is forgotten
    assert set(state["started"]) <= resumed.started_ids
    fresh = resumed.started_ids - set(state["started"])
    assert fresh and min(int(g.rsplit("-", 1)[1]) for g in fresh) == state["next_group"]
    assert not restored_ids(state) & set(resumed.buffer.dropped)
    for gid, reason in state["buffer"]["dropped"].items():
        assert resumed.buffer.dropped[gid] == reason


def restored_ids(state: dict) -> set[str]:
    return {g["group_id"] for g in state["open"]}
