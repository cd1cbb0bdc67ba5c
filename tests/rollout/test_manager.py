"""RolloutManager on a real embedded engine: groups, staleness under a slow trainer and a slow
engine, oversampling / zero-variance accounting. The "trainer" is a loop that consumes a batch,
sleeps for its step, then swaps the engine's weights (abort-mode pause) to the next version."""

from __future__ import annotations

import asyncio

import pytest

from moe_rl.rollout import RolloutConfig, RolloutManager, staleness
from tests.rollout.conftest import LAYERS, TOPK
from tests.rollout.rollout_helpers import cancel, make_pool, swap_weights

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)


async def train(manager, pool, model_dir, steps: int, step_s: float) -> list[int]:
    """Consume `steps` batches; return the staleness of every sample consumed."""
    seen = []
    for _ in range(steps):
        batch = await manager.buffer.get_batch(manager.config.groups_per_step)
        seen += [staleness(s, manager.buffer.version) for g in batch for s in g]
        await asyncio.sleep(step_s)
        version = manager.buffer.version + 1
        await swap_weights(pool, model_dir, version)
        await manager.buffer.set_version(version)
    return seen


async def run_loop(url, model_dir, config, steps, step_s):
    pool = make_pool(url)
    version = int((await pool.clients[0].model_info())["weight_version"])
    manager = RolloutManager(config, pool, version=version)
    generation = asyncio.create_task(manager.run())
    seen = await train(manager, pool, model_dir, steps, step_s)
    await cancel(generation)
    await pool.close()
    manager.close()
    return manager, seen


def check_ledger(manager):
    """Every group id started is delivered, dropped, or still queued: exactly one of them."""
    buffer = manager.buffer
    delivered, dropped, queued = set(buffer.delivered), set(buffer.dropped), buffer.queued_ids()
    assert not (delivered & dropped) and not (delivered & queued) and not (dropped & queued)
    assert delivered | dropped | queued == manager.started_ids
    counts = manager.accounting()
    assert counts["open"] == 0
    assert counts["started"] == counts["delivered"] + counts["dropped"] + counts["queued"]


def test_manager_collects_scored_groups(engine, model_dirs):
    config = RolloutConfig(groups_per_step=3, n_samples_per_prompt=4, max_new_tokens=6, max_staleness=1)

    async def go():
        pool = make_pool(engine.url)
        manager = RolloutManager(config, pool, version=int((await pool.clients[0].model_info())["weight_version"]))
        generation = asyncio.create_task(manager.run(num_rounds=1))
        batch = await manager.buffer.get_batch(3)
        await generation
        await pool.close()
        return manager, batch

    manager, batch = asyncio.run(go())
    assert len(batch) == 3 and len({g[0].group_id for g in batch}) == 3
    for group in batch:
        assert (
            len(group) == 4 and len({s.group_id for s in group}) == 1 and len({tuple(s.prompt_ids) for s in group}) == 1
        )
        for sample in group:
            answer = sample.metadata["answer"]
            assert sample.reward == sum(a == str(t % 10) for a, t in zip(answer, sample.response_ids)) / len(answer)
            assert len(sample.response_ids) == 6 and sample.status == "truncated"
            assert sample.routed_experts.shape == (len(sample.prompt_ids) + 5, LAYERS, TOPK)
    check_ledger(manager)
    manager.close()


def test_slow_trainer_holds_generation_back_within_the_bound(engine, model_dirs):
    config = RolloutConfig(groups_per_step=2, n_samples_per_prompt=2, max_new_tokens=8, max_staleness=1)
    manager, seen = asyncio.run(run_loop(engine.url, model_dirs[1], config, steps=4, step_s=0.6))
    metrics = manager.metrics()
    assert max(seen) <= 1 and metrics["buffer/staleness_max"] <= 1
    assert metrics["buffer/backpressure_waits"] > 0 and metrics["buffer/backpressure_s"] > 0.5
    assert len(manager.buffer) <= (config.max_staleness + 1) * config.groups_per_step  # bounded
    check_ledger(manager)


def test_slow_engine_makes_the_trainer_wait_within_the_bound(engine, model_dirs):
    config = RolloutConfig(
        groups_per_step=2, n_samples_per_prompt=4, max_new_tokens=150, max_staleness=1, stale_policy="requeue"
    )
    manager, seen = asyncio.run(run_loop(engine.url, model_dirs[0], config, steps=3, step_s=0.0))
    metrics = manager.metrics()
    assert max(seen) <= 1 and metrics["buffer/trainer_wait_s"] > 0.3
    check_ledger(manager)


def test_oversampling_and_zero_variance_groups_are_accounted(engine, model_dirs):
    # Round 0 starts g0-0..g0-3: g0-0 and g0-3 score flat, never delivered (no refill: the other
    # two take the 2 places). A flat group that ends before the places are taken is dropped as
    # zero_variance, one that ends after as oversampled: which comes first is the engine's order.
    config = RolloutConfig(
        groups_per_step=2,
        n_samples_per_prompt=4,
        max_new_tokens=3,
        max_staleness=0,
        reward="tests.rollout.rollout_helpers:every_third_group_flat",
        drop_zero_variance_groups=True,
        oversample_factor=2.0,
    )
    manager, seen = asyncio.run(run_loop(engine.url, model_dirs[1], config, steps=4, step_s=0.0))
    counts = manager.accounting()
    assert counts["delivered"] == 8 and max(seen) == 0, counts
    assert counts.get("dropped_zero_variance", 0) > 0 and counts.get("dropped_oversampled", 0) > 0, counts
    assert manager.buffer.dropped["g0-0"] in ("zero_variance", "oversampled")
    for gid in manager.buffer.delivered:
        assert gid not in manager.buffer.dropped and int(gid.rsplit("-", 1)[1]) % 3 != 0
    check_ledger(manager)


def test_an_engine_refusing_every_request_ends_the_run_with_its_cause(engine, model_dirs):
    """max_new_tokens beyond the context: every /generate is a 400; the endless run must fail with
    it, not wait forever on back-pressure (a trainer waiting for its first batch sees the cause)."""
    import pytest

    from moe_rl.engine.client import EngineError

    config = RolloutConfig(groups_per_step=2, n_samples_per_prompt=2, max_new_tokens=2000, max_staleness=1)

    async def go():
        pool = make_pool(engine.url)
        manager = RolloutManager(config, pool, version=int((await pool.clients[0].model_info())["weight_version"]))
        try:
            await asyncio.wait_for(manager.run(), timeout=60)  # forever, unless it fails
        finally:
            await pool.close()
            manager.close()

    with pytest.raises(EngineError, match="max_position_embeddings"):
        asyncio.run(go())
