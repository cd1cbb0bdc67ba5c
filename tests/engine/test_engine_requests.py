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
    ({"input_ids": [[1, 2], [3]], "sampling_params": [{"max_new_tokens": 2}]}, "sampling_params: a list of 1"),
    ({"input_ids": [[1, 2], [3]], "rid": ["a", "a"]}, "must be distinct within a batch"),
    ({"input_ids": [[1, 2], [3, 256]]}, "outside the vocabulary"),
    ({"input_ids": [[1, 2], [3]], "sampling_params": [{}, {"max_tokens": 3}]}, "sampling_params.max_tokens"),
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
        self.hold: asyncio.Event | None = None  # when set up, /generate answers once it is set

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else {}
        self.bodies.append((request.path, body))
        if self.fail_first > 0:
            self.fail_first -= 1
            return web.Response(status=503)
        if request.path == "/generate" and self.hold is not None:
            await self.hold.wait()
        if request.path == "/generate":  # a batch (SGLang's list form) gets a list
            items = protocol.split_batch(body)
            answers = [self._generated(item) for item in items or [body]]
            return web.json_response(answers if items is not None else answers[0])
        if request.path == "/model_info":
            return web.json_response({"weight_version": "3"})
        return web.json_response({"success": True, "message": ""})

    def _generated(self, body: dict) -> dict:
        """`max_new_tokens` copies of the prompt's first id (so a batch's answers show their order)."""
        n = body["sampling_params"]["max_new_tokens"]
        meta = {
            "id": body["rid"],
            "finish_reason": {"type": "length", "length": n},
            "weight_version": self.version_label,
            "output_token_logprobs": [[-1.0, body["input_ids"][0], None]] * n,
        }
        return {"output_ids": [body["input_ids"][0]] * n, "meta_info": meta}

    def generated(self) -> list[dict]:
        """The /generate requests received, a batch's items each (`protocol.split_batch`)."""
        bodies = [body for path, body in self.bodies if path == "/generate"]
        return [item for body in bodies for item in protocol.split_batch(body) or [body]]

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
    assert result.output_ids == [1, 1, 1] and result.weight_versions == [3] * 3 and info["weight_version"] == "3"
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
        return [(len(e.bodies), len(e.generated())) for e in engines], pool

    counts, pool = run(go())
    # 3 groups of 4 on distinct engines, each group one batch request; then 2 requests each
    assert counts == [(3, 6)] * 3
    assert pool.in_flight == [0, 0, 0]


def test_a_group_started_together_is_one_batch_request_answered_in_order():
    """Requests of one group made in one pass of the loop, with the same options, go as one
    SGLang batch body; other options or another pass make their own; each caller gets its item."""

    async def go():
        engine = RecordingEngine()
        pool = EnginePool([EngineClient(await engine.start())])
        ask = lambda first, **options: pool.generate([first, 9], SamplingParams(max_new_tokens=2), **options)  # noqa: E731
        together = await asyncio.gather(*(ask(i, group_id="g") for i in range(1, 6)))
        split = await asyncio.gather(ask(1, group_id="g"), ask(2, group_id="g", routed_experts_start_len=1))
        later = await ask(3, group_id="g")
        await pool.close()
        await engine.runner.cleanup()
        return engine, together, split, later

    engine, together, split, later = run(go())
    assert [r.output_ids for r in together] == [[i, i] for i in range(1, 6)]
    assert [r.output_ids for r in split] == [[1, 1], [2, 2]] and later.output_ids == [3, 3]
    first, *rest = [body for path, body in engine.bodies if path == "/generate"]
    assert first["input_ids"] == [[i, 9] for i in range(1, 6)] and len(set(first["rid"])) == 5
    assert [isinstance(b["input_ids"][0], int) for b in rest] == [True, True, True]  # one request: the single form


def test_a_caller_that_stops_waiting_has_its_item_aborted_and_the_others_go_on():
    async def go():
        engine = RecordingEngine()
        engine.hold = asyncio.Event()
        pool = EnginePool([EngineClient(await engine.start())])

        def ask(first: int) -> asyncio.Future:
            return asyncio.ensure_future(pool.generate([first], SamplingParams(max_new_tokens=1), group_id="g"))

        calls = [ask(1), ask(2)]
        while not engine.generated():  # the batch reached the engine
            await asyncio.sleep(0.01)
        calls[0].cancel()
        while len(engine.bodies) < 2:
            await asyncio.sleep(0.01)
        engine.hold.set()
        kept = await calls[1]
        engine.hold.clear()
        both = [ask(3), ask(4)]  # every caller gone: the request itself is cancelled, nothing to abort
        while len(engine.generated()) < 4:
            await asyncio.sleep(0.01)
        for call in both:
            call.cancel()
        await asyncio.gather(*both, return_exceptions=True)
        in_flight = list(pool.in_flight)
        engine.hold.set()  # the abandoned request's handler ends (the server's cleanup waits for it)
        await pool.close()
        await engine.runner.cleanup()
        return engine.bodies, kept, in_flight

    bodies, kept, in_flight = run(go())
    (_, batch), (path, abort) = bodies[:2]
    assert path == "/abort_request" and abort["rid"] == batch["rid"][0]  # the cancelled item alone
    assert kept.output_ids == [2] and kept.finish_reason == "length"
    assert [path for path, _ in bodies[2:]] == ["/generate"] and in_flight == [0]
