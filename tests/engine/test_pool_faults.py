"""`EnginePool` around engines that die: two embedded engines (real processes), SIGKILL one while
it generates. Its requests are resubmitted to the live engine and complete; it gets no new work
until revived; with no engine live, requests wait for a revived one."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from moe_rl.engine.client import EngineClient
from moe_rl.engine.pool import EnginePool
from moe_rl.engine.process import EmbeddedConfig, launch_embedded
from moe_rl.engine.sampling import SamplingParams

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

TOKENS = 96


async def _wait_in_flight(pool: EnginePool, index: int, count: int) -> None:
    deadline = time.monotonic() + 30
    while pool.in_flight[index] < count:
        assert time.monotonic() < deadline, pool.in_flight
        await asyncio.sleep(0.002)


def test_dead_engine_requests_resubmitted_then_revived(qwen3_dir):
    engines = [launch_embedded(EmbeddedConfig(model_path=qwen3_dir, weight_version="3", threads=1)) for _ in range(2)]
    restarted = None

    async def scenario():
        nonlocal restarted
        pool = EnginePool([EngineClient(e.url, name=f"engine-{i}") for i, e in enumerate(engines)])
        sampling = SamplingParams(max_new_tokens=TOKENS, ignore_eos=True, temperature=1.0)
        try:
            # 1. eight requests, four groups of two: both engines busy; kill engine-0 mid-generation
            requests = [
                asyncio.ensure_future(pool.generate([1, 2, 3 + i], sampling, group_id=f"g{i // 2}")) for i in range(8)
            ]
            await _wait_in_flight(pool, 0, 4)
            start = time.perf_counter()
            os.kill(engines[0].process.pid, signal.SIGKILL)
            results = await asyncio.gather(*requests)
            recovered_s = time.perf_counter() - start
            assert all(len(r.output_ids) == TOKENS and r.finish_reason == "length" for r in results)
            assert pool.live == [False, True] and pool.resubmitted == 4
            assert pool.generated_tokens == 8 * TOKENS  # completed requests only: a lost one counts once
            assert pool.served == [0, 8] and recovered_s < 30
            # 2. new work only goes to the live engine
            await pool.generate([5, 6], sampling, group_id="g9")
            assert pool.served == [0, 9]

            # 3. engine-1 dies too: a request waits (no engine live) until engine-0 is revived
            engines[1].stop()
            waiting = asyncio.ensure_future(pool.generate([7, 8], sampling, group_id="g10"))
            while pool.live[1]:
                await asyncio.sleep(0.01)
            assert not waiting.done()
            restarted = await asyncio.to_thread(
                launch_embedded, EmbeddedConfig(model_path=qwen3_dir, weight_version="3", threads=1)
            )
            await pool.revive(0, EngineClient(restarted.url, name="engine-0"))
            result = await waiting
            assert len(result.output_ids) == TOKENS and result.weight_version == 3
            assert pool.live == [True, False] and pool.served[0] == 1
            assert pool.resubmitted == 5  # it was first sent to engine-1, found dead there
        finally:
            await pool.close()
        print(f"recovered in {recovered_s:.2f} s")

    try:
        asyncio.run(scenario())
    finally:
        for engine in [*engines, restarted]:
            if engine is not None:
                engine.stop()
