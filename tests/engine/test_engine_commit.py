"""A commit answered before its swap (`moe_rl.engine.embedded.server`): the sender does not wait
for the spare model's load, and nothing observable runs ahead of the swap.

The embedded server runs in this process (its scheduler thread, its aiohttp app on loopback), so
the test holds the spare model's load (`ModelRunner.build_staged`) on an event and looks at the
engine while it is held: the commit's answer came, the running request goes on decoding under
the old version, new requests wait, /model_info waits; then the load goes on. A load that fails
leaves the old version served and the engine unhealthy.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from aiohttp import web

from moe_rl.engine.client import EngineClient, EngineError
from moe_rl.engine.embedded.runner import load_checkpoint_state
from moe_rl.engine.embedded.server import EmbeddedServer
from moe_rl.engine.sampling import SamplingParams
from tests.engine.engine_helpers import run, save_tiny_model, wait_for_load, wait_until_decoding
from tests.engine.test_engine_weights import PROMPTS, generate, matches


@pytest.fixture(scope="module")
def new_dir(tmp_path_factory):
    return save_tiny_model("qwen3_moe", tmp_path_factory.mktemp("qwen3_new"), seed=1)


class HeldLoad:
    """`build_staged` of `server`'s runner, held until `go` is set (or failing then, `fail`)."""

    def __init__(self, server: EmbeddedServer, fail: bool = False):
        self.started, self.go, self.fail = threading.Event(), threading.Event(), fail
        self.build = server.runner.build_staged
        server.runner.build_staged = self

    def __call__(self, tensors):
        self.started.set()
        assert self.go.wait(120), "the test never let the load go on"
        if self.fail:
            raise RuntimeError("injected: the spare model could not be loaded")
        return self.build(tensors)


async def serving(server: EmbeddedServer, body):
    """`body(client, url)` against `server`'s app on a loopback port."""
    app = web.AppRunner(server.app())
    await app.setup()
    site = web.TCPSite(app, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{app.addresses[0][1]}"
    client = EngineClient(url)
    try:
        return await body(client, url)
    finally:
        await client.close()
        await app.cleanup()


def stage(server: EmbeddedServer, model_dir) -> None:
    """A whole version staged as a bucket handed over in memory would be."""
    server.receiver.begin()
    server.receiver.stage_tensors(load_checkpoint_state(model_dir))


def test_a_commit_is_answered_before_its_swap_and_nothing_starts_ahead_of_it(qwen3_dir, new_dir):
    server = EmbeddedServer(str(qwen3_dir), "0")
    held = HeldLoad(server)

    async def body(client, url):
        running = asyncio.create_task(
            client.generate(PROMPTS[0], SamplingParams(max_new_tokens=200, sampling_seed=0, ignore_eos=True))
        )
        await wait_until_decoding(url, 1)
        stage(server, new_dir)
        await client.update_weight_version("1")  # answered while its load is held
        assert held.started.wait(60) and not held.go.is_set()
        after = asyncio.create_task(generate(client))
        info = asyncio.create_task(client.model_info())
        # the new requests wait in the queue while the running one goes on decoding (version 0)
        await wait_for_load(url, lambda load: load["num_waiting_reqs"] == len(PROMPTS), "queued the new requests")
        await wait_until_decoding(url, 1, steps=3)
        assert not after.done() and not info.done() and not running.done()
        held.go.set()
        return await running, await after, await info

    crossing, after, info = run(serving(server, body))
    server.scheduler.stop()
    assert crossing.weight_versions[0] == 0 and crossing.weight_versions[-1] == 1
    assert all(set(r.weight_versions) == {1} for r in after) and matches(new_dir, after)
    assert info["weight_version"] == "1"


def test_a_swap_that_fails_after_the_answer_leaves_the_old_version_and_an_unhealthy_engine(qwen3_dir, new_dir):
    server = EmbeddedServer(str(qwen3_dir), "0")
    held = HeldLoad(server, fail=True)

    async def body(client, url):
        stage(server, new_dir)
        await client.update_weight_version("1")
        after = asyncio.gather(*(client.generate(p, SamplingParams(max_new_tokens=4)) for p in PROMPTS))
        await wait_for_load(url, lambda load: load["num_waiting_reqs"] == len(PROMPTS), "queued the new requests")
        held.go.set()
        results = await after  # released: they run under the served version
        with pytest.raises(EngineError, match="failed to load: RuntimeError: injected") as refused:
            await client.model_info()
        return results, refused.value.status, await client.health()

    results, status, healthy = run(serving(server, body))
    server.scheduler.stop()
    assert all(set(r.weight_versions) == {0} for r in results) and server.scheduler.weight_version == "0"
    assert status == 500 and not healthy
