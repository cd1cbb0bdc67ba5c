"""One request never harms another: bad sampling values are refused up front, a request whose
own sampling or forward fails fails alone, and nothing queued meanwhile is lost."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from moe_rl.engine.client import EngineClient
from moe_rl.engine.embedded.request import Request
from moe_rl.engine.embedded.runner import ModelRunner
from moe_rl.engine.embedded.scheduler import Scheduler
from moe_rl.engine.sampling import SamplingParams
from tests.engine.engine_helpers import run, wait_for_load
from tests.engine.test_engine_requests import post

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

PROMPT = [5, 6, 7, 8]


@pytest.mark.parametrize("temperature", ["NaN", "Infinity", "-1", "true", '"hot"'])
def test_non_finite_or_bad_temperature_is_a_400(qwen3_engine, temperature):
    body = '{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "temperature": %s}}' % temperature
    status, text = post(qwen3_engine.url + "/generate", body.encode())
    assert status == 400 and "temperature" in text


def test_a_tiny_temperature_is_greedy_and_harms_no_other_request(qwen3_engine):
    """1e-38 overflowed the scores and failed every request of the batch; SGLang samples greedily
    below 1e-6, and so does the embedded engine."""

    async def go():
        client = EngineClient(qwen3_engine.url)
        greedy = await client.generate(PROMPT, SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True))
        results = await asyncio.gather(
            client.generate(PROMPT, SamplingParams(max_new_tokens=6, temperature=1e-38, ignore_eos=True)),
            *[
                client.generate(
                    PROMPT, SamplingParams(max_new_tokens=6, temperature=1.0, sampling_seed=i, ignore_eos=True)
                )
                for i in range(4)
            ],
        )
        await client.close()
        return greedy, results

    greedy, results = run(go())
    assert results[0].output_ids == greedy.output_ids
    assert all(len(r.output_ids) == 6 and r.finish_reason == "length" for r in results)


def test_a_batch_request_gives_each_item_what_it_alone_would_get(qwen3_engine):
    """SGLang's batch form of /generate: one answer per item, in order, each what the same request
    sent alone gets (seeded sampling); an item aborted by its rid ends alone."""
    seeded = [SamplingParams(max_new_tokens=6, temperature=1.0, sampling_seed=i, ignore_eos=True) for i in range(3)]
    prompts = [PROMPT, PROMPT[:2], PROMPT]

    async def go():
        client = EngineClient(qwen3_engine.url)
        alone = [await client.generate(p, s, return_routed_experts=True) for p, s in zip(prompts, seeded)]
        batch = await client.generate_batch(prompts, seeded, return_routed_experts=True)
        long = SamplingParams(max_new_tokens=400, ignore_eos=True)
        cut = asyncio.ensure_future(client.generate_batch([PROMPT, PROMPT], [long, seeded[0]], rids=["victim", "kept"]))
        await wait_for_load(client.url, lambda load: load["num_used_tokens"] >= len(PROMPT) + 8, "decoding the batch")
        await client.abort_request("victim")
        victim, kept = await asyncio.wait_for(cut, 60)
        await client.close()
        return alone, batch, victim, kept

    alone, batch, victim, kept = run(go())
    for one, item in zip(alone, batch):
        # a batch's forwards hold other rows: float32 sums in another order, the tokens the same
        assert item.output_ids == one.output_ids and np.allclose(item.logprobs, one.logprobs, atol=1e-4)
        assert np.array_equal(item.routed_experts, one.routed_experts)
    assert victim.rid == "victim" and victim.finish_reason == "abort" and len(victim.output_ids) < 400
    assert kept.output_ids == alone[0].output_ids and kept.finish_reason == "length"


def test_a_failing_forward_fails_its_requests_and_loses_none_queued_meanwhile(qwen3_dir):
    """The forward of one request raises; a request submitted while it fails still completes."""
    runner = ModelRunner(str(qwen3_dir))
    scheduler = Scheduler(runner, "0")
    results: dict[str, object] = {}
    finished = {rid: threading.Event() for rid in ("bad", "late", "other")}

    def make(rid: str, ids: list[int]) -> Request:
        def on_done(result, rid=rid):
            results[rid] = result
            finished[rid].set()

        return Request(
            rid=rid,
            input_ids=ids,
            params=SamplingParams(max_new_tokens=3, ignore_eos=True),
            eos_token_ids=frozenset(),
            on_done=on_done,
        )

    forward = runner.forward

    def failing_forward(ids, mask, cache, loras, *scoring):
        if (ids == 99).any():  # the "bad" request's prompt: a model error in its prefill
            scheduler.submit(make("late", PROMPT))  # arrives while the failure is handled
            raise RuntimeError("model error in this forward")
        return forward(ids, mask, cache, loras, *scoring)

    runner.forward = failing_forward
    try:
        scheduler.submit(make("bad", [99, 1, 2]))
        for rid in ("bad", "late"):
            assert finished[rid].wait(60), f"request {rid!r} was never answered"
        scheduler.submit(make("other", PROMPT))
        assert finished["other"].wait(60)
    finally:
        scheduler.stop()
    assert isinstance(results["bad"], RuntimeError)
    for rid in ("late", "other"):
        assert len(results[rid]["output_ids"]) == 3, rid


def test_a_huge_body_is_refused_without_stalling_the_server(qwen3_engine):
    import socket
    import time
    import urllib.request

    host, port = qwen3_engine.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        size = 95 << 20
        sock.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % size
        )
        sock.sendall(b"[" + b"1," * (1 << 20))  # the server is reading (or refusing) a huge body...
        start = time.monotonic()
        with urllib.request.urlopen(qwen3_engine.url + "/health", timeout=10) as response:  # ...and still answers
            assert response.status == 200
        assert time.monotonic() - start < 2
        sock.settimeout(30)
        assert sock.recv(64).startswith(b"HTTP/1.1 413")


def test_a_client_that_disconnects_has_its_generation_aborted(qwen3_engine):
    """Two identical 500-token requests decode in one batch; one client disconnects. Its request
    must leave the batch while the other still runs (without the abort both end at the same step)."""
    import socket
    import threading
    import time

    host, port = qwen3_engine.url.removeprefix("http://").split(":")
    body = b'{"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 500, "ignore_eos": true}}'
    kept = {}

    def running() -> int:
        return sum(
            load["num_running_reqs"] + load["num_waiting_reqs"] for load in json_get(qwen3_engine.url + "/get_load")
        )

    def keep() -> None:
        kept["status"] = post(qwen3_engine.url + "/generate", body)[0]

    other = threading.Thread(target=keep)
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        other.start()
        deadline = time.monotonic() + 30
        while running() < 2:
            assert time.monotonic() < deadline, "the two requests never ran together"
            time.sleep(0.02)
    deadline = time.monotonic() + 30
    while running() != 1:  # the disconnected one is gone, the other still decodes
        assert other.is_alive(), "the disconnected client's generation ran to the end"
        assert time.monotonic() < deadline
        time.sleep(0.02)
    other.join(60)
    assert kept["status"] == 200


def json_get(url: str):
    import json
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())
