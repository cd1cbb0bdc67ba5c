"""Bad requests get HTTP 400 naming the problem and the engine keeps serving; the client's bodies use
SGLang's field names only; retries; the pool's routing."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest
from aiohttp import web

from moe_rl.engine import protocol
from moe_rl.engine.client import EngineClient, EngineError
from moe_rl.engine.pool import EnginePool
from moe_rl.engine.process import free_port
from moe_rl.engine.sampling import SamplingParams
from tests.engine.engine_helpers import run

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)


def post(url: str, body) -> tuple[int, str]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


BAD = [
    ({"sampling_params": {"max_new_tokens": 2}}, "input_ids"),
    ({"input_ids": [1, 256], "sampling_params": {"max_new_tokens": 2}}, "outside the vocabulary"),
    ({"input_ids": [1, -1]}, "outside the vocabulary"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"input_ids": [1, 2], "max_new_tokens": 3}, "unknown field"),
    ({"input_ids": [1, 2], "sampling_params": {"max_tokens": 3}}, "sampling_params.max_tokens"),
    ({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, "top_p"),
    ({"input_ids": [1, 2], "stream": True}, "stream"),
    ({"input_ids": [], "sampling_params": {"max_new_tokens": 2}}, "input_ids"),
    ({"input_ids": [1, 2], "lora_path": "nope"}, "not loaded"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 511}}, "exceeds the model's 512 positions"),
]


@pytest.mark.parametrize("body,message", BAD)
def test_bad_generate_requests_get_400(qwen3_engine, body, message):
    status, text = post(qwen3_engine.url + "/generate", body)
    assert status == 400 and message in text, text


def test_bad_control_requests_and_the_engine_keeps_serving(qwen3_engine):
    url = qwen3_engine.url
    assert post(url + "/generate", b"{not json")[0] == 400
    assert post(url + "/pause_generation", {"mode": "sleep"})[0] == 400
    assert post(url + "/update_weights_from_disk", {})[0] == 400
    assert (
        post(
            url + "/update_weights_from_distributed",
            {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "weight_version": "1"},
        )[0]
        == 400
    )  # no group joined
    assert post(url + "/load_lora_adapter", {"lora_name": "a", "lora_path": "/nonexistent"})[0] == 400
    status, text = post(url + "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
    assert status == 200 and len(json.loads(text)["output_ids"]) <= 2


class RecordingEngine:
    """A real aiohttp server that records every body and answers like SGLang; fails the first
    `fail_first` requests with 503 (a transient error)."""

    def __init__(self, fail_first: int = 0, version_label: str = "3"):
        self.bodies: list[tuple[str, dict]] = []
        self.fail_first, self.version_label = fail_first, version_label

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else {}
        self.bodies.append((request.path, body))
        if self.fail_first > 0:
            self.fail_first -= 1
            return web.Response(status=503)
        if request.path == "/generate":
            n = body["sampling_params"]["max_new_tokens"]
            meta = {
                "id": body["rid"],
                "finish_reason": {"type": "length", "length": n},
                "weight_version": self.version_label,
                "output_token_logprobs": [[-1.0, 5, None]] * n,
            }
            return web.json_response({"output_ids": [5] * n, "meta_info": meta})
        if request.path == "/model_info":
            return web.json_response({"weight_version": "3"})
        return web.json_response({"success": True, "message": ""})

    async def start(self) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        return f"http://127.0.0.1:{port}"


def test_client_sends_only_sglang_field_names():
    async def go():
        engine = RecordingEngine()
        client = EngineClient(await engine.start(), kind="sglang", backoff_s=0.01)
        await client.generate(
            [1, 2],
            SamplingParams(max_new_tokens=2, temperature=0.7, top_p=0.9, top_k=5, stop_token_ids=[3], sampling_seed=1),
            return_routed_experts=False,
            routed_experts_start_len=1,
            lora_path="a",
        )
        await client.pause_generation("retract")
        await client.continue_generation()
        await client.abort_request("r1")
        await client.abort_request()
        await client.flush_cache()
        await client.update_weights_from_disk("/tmp/x", "2")
        await client.init_weights_update_group("127.0.0.1", 1234, 1, 2, "g", "nccl")
        await client.update_weights_from_distributed(
            ["w"], ["bfloat16"], [[2, 2]], "g", "2", "flattened_bucket", checksum="crc32:00000000"
        )
        await client.update_weights_from_tensor(["cGF5bG9hZA=="], "flattened_bucket", "2")
        await client.update_weight_version("2")
        await client.destroy_weights_update_group("g")
        await client.load_lora_adapter("a", "/tmp/a")
        await client.close()
        await engine.runner.cleanup()
        return engine.bodies

    bodies = run(go())
    assert {path for path, _ in bodies} >= {
        "/generate",
        "/pause_generation",
        "/update_weights_from_distributed",
        "/update_weights_from_tensor",
    }
    for path, body in bodies:
        assert set(body) <= protocol.REQUEST_FIELDS[path], (path, set(body) - protocol.REQUEST_FIELDS[path])
        assert all(field in body for field in protocol.REQUIRED_FIELDS.get(path, ())), (path, body)
        if path == "/generate":
            assert set(body["sampling_params"]) <= protocol.SAMPLING_FIELDS


def test_retries_transient_errors_then_gives_up():
    async def go():
        flaky, dead = RecordingEngine(fail_first=2), RecordingEngine(fail_first=100)
        client = EngineClient(await flaky.start(), retries=3, backoff_s=0.01)
        result = await client.generate([1], SamplingParams(max_new_tokens=3))
        info = await client.model_info()
        gone = EngineClient(await dead.start(), retries=2, backoff_s=0.01)
        with pytest.raises(EngineError, match="503"):
            await gone.pause_generation("abort")
        refused = EngineClient(f"http://127.0.0.1:{free_port()}", retries=1, backoff_s=0.01)
        with pytest.raises(EngineError, match="ClientConnectorError"):
            await refused.model_info()
        assert not await refused.health()
        for c in (client, gone, refused):
            await c.close()
        for e in (flaky, dead):
            await e.runner.cleanup()
        return result, info, len(dead.bodies)

    result, info, attempts = run(go())
    assert result.output_ids == [5, 5, 5] and result.weight_versions == [3] * 3 and info["weight_version"] == "3"
    assert attempts == 3


def test_a_version_label_that_is_not_an_integer_is_named():
    """SGLang's default label is "default"; the project counts versions as integers."""

    async def go():
        engine = RecordingEngine(version_label="default")
        client = EngineClient(await engine.start(), backoff_s=0.01)
        try:
            with pytest.raises(EngineError, match="weight_version 'default' is not a non-negative integer"):
                await client.generate([1], SamplingParams(max_new_tokens=2))
        finally:
            await client.close()
            await engine.runner.cleanup()

    run(go())


def test_pool_keeps_groups_together_and_balances_the_rest():
    async def go():
        engines = [RecordingEngine() for _ in range(3)]
        pool = EnginePool([EngineClient(await e.start()) for e in engines])
        await asyncio.gather(
            *(pool.generate([1], SamplingParams(max_new_tokens=1), group_id=f"g{i // 4}") for i in range(12))
        )
        await asyncio.gather(*(pool.generate([1], SamplingParams(max_new_tokens=1)) for _ in range(6)))
        await pool.close()
        for e in engines:
            await e.runner.cleanup()
        return [len(e.bodies) for e in engines], pool

    counts, pool = run(go())
    assert sorted(counts) == [6, 6, 6]  # 3 groups of 4 on distinct engines, then 2 each
    assert pool.in_flight == [0, 0, 0]
