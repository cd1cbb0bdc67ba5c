"""`EnginePool.add` / `remove` (elastic engines, `moe_rl.rl.fleet`) against SGLang-shaped HTTP
servers that hold each request until it is aborted: a removed engine's requests come back cut
(finish reason abort, with their tokens so far) and its groups move; a new engine takes a slot at
its index (skipped slots stay empty) and gets work at once."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from moe_rl.engine.client import EngineClient
from moe_rl.engine.pool import EnginePool
from moe_rl.engine.sampling import SamplingParams
from tests.engine.engine_helpers import run

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)


class HoldingEngine:
    """Answers /generate with 2 tokens of version `version` once `/abort_request` (abort) or
    `release()` (length) ends it."""

    def __init__(self, version: int):
        self.version, self.ended, self.reason = version, asyncio.Event(), "length"

    async def handle(self, request: web.Request) -> web.Response:
        if request.path == "/abort_request":
            self.reason = "abort"
            self.ended.set()
            return web.json_response({"success": True})
        body = await request.json()
        await self.ended.wait()
        meta = {
            "id": body["rid"],
            "finish_reason": {"type": self.reason},
            "weight_version": str(self.version),
            "output_token_logprobs": [[-1.0, 5, None]] * 2,
        }
        return web.json_response({"output_ids": [5, 5], "meta_info": meta})

    def release(self) -> None:
        self.ended.set()

    async def start(self) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


async def _in_flight(pool: EnginePool, expected: list[int]) -> None:
    while pool.in_flight != expected:
        await asyncio.sleep(0.005)


def test_remove_cuts_requests_and_add_takes_a_new_slot():
    async def go():
        engines = [HoldingEngine(version=4), HoldingEngine(version=4), HoldingEngine(version=5)]
        urls = [await e.start() for e in engines]
        pool = EnginePool([EngineClient(urls[i], name=f"engine-{i}") for i in range(2)])
        sampling = SamplingParams(max_new_tokens=8)
        try:
            first = asyncio.ensure_future(pool.generate([1], sampling, group_id="g0"))
            second = asyncio.ensure_future(pool.generate([1], sampling, group_id="g1"))
            await _in_flight(pool, [1, 1])  # one group on each engine

            # remove engine-1: its request comes back cut, its slot is empty, its group moves
            assert await asyncio.wait_for(pool.remove(1), 10) == 1
            cut = await second
            assert cut.finish_reason == "abort" and cut.output_ids == [5, 5]
            assert pool.live == [True, False] and pool.clients[1] is None
            assert (pool.removed, pool.cut) == (1, 1) and pool.pick("g1") == 0
            with pytest.raises(ValueError, match="holds no engine"):
                await pool.remove(1)

            # add engine-3 (slot 2 stays empty): it takes new work at once, engine-0 being busy
            pool.add(3, EngineClient(urls[2], name="engine-3"))
            with pytest.raises(ValueError, match="index: engine slot 0 holds engine-0; give a new engine a free one"):
                pool.add(0, EngineClient(urls[2], name="engine-0"))
            assert pool.live == [True, False, False, True] and pool.clients[2] is None and pool.added == 1
            third = asyncio.ensure_future(pool.generate([1], sampling, group_id="g2"))
            await _in_flight(pool, [1, 0, 0, 1])
            engines[2].release()
            assert (await third).weight_version == 5
            assert pool.served[3] == 1 and pool.versions[3] == (5, 5) and pool.versions[2] is None
            engines[0].release()
            assert (await first).finish_reason == "length"
        finally:
            await pool.close()
            for engine in engines:
                await engine.runner.cleanup()

    run(go())
