"""A bounded, loopback-only fuzz of the embedded engine's HTTP API: malformed JSON, wrong types,
extreme values, huge bodies, bad control calls, sent concurrently with good greedy requests.
The server never answers 500, never drops a good request, and serves the same greedy output
before and after."""

from __future__ import annotations

import concurrent.futures as cf
import json
import random

import pytest

from tests.engine.test_engine_requests import post

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

GOOD = {"input_ids": [3, 1, 4, 1, 5], "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
VALUES = [
    None,
    True,
    -1,
    0,
    2**70,
    -(2**70),
    1e308,
    "NaN",
    "",
    "x" * 1000,
    [],
    [None],
    {},
    {"a": 1},
    [2**40],
    [-5, 3],
    0.5,
    "1",
]
ROUTES = [
    "/generate",
    "/pause_generation",
    "/abort_request",
    "/update_weight_version",
    "/load_lora_adapter",
    "/init_weights_update_group",
    "/update_weights_from_distributed",
    "/update_weights_from_disk",
    "/release_memory_occupation",
    "/begin_weight_update",
    "/end_weight_update",
    "/flush_cache",
]
SAFE = {"/pause_generation", "/release_memory_occupation", "/update_weights_from_disk", "/init_weights_update_group"}
"""Routes whose valid calls would change the engine's state for the good requests: fuzzed only with
bodies that cannot be valid for them."""


def bad_bodies(rng: random.Random, count: int) -> list[tuple[str, bytes]]:
    bodies = [
        ("/generate", b"{"),
        ("/generate", b"[1, 2"),
        ("/generate", b"\xff\xfe"),
        ("/generate", b"null"),
        ("/generate", b'"text"'),
        ("/generate", json.dumps({"input_ids": list(range(300))}).encode()),
    ]
    fields = [
        "input_ids",
        "sampling_params",
        "rid",
        "return_logprob",
        "routed_experts_start_len",
        "lora_path",
        "logprob_start_len",
        "stream",
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "mode",
        "new_version",
        "names",
        "dtypes",
        "shapes",
        "master_port",
        "world_size",
        "tags",
        "lora_name",
    ]
    while len(bodies) < count:
        route = rng.choice(ROUTES)
        body = {field: rng.choice(VALUES) for field in rng.sample(fields, rng.randint(1, 4))}
        if route == "/generate" and rng.random() < 0.5:
            body = {
                **GOOD,
                "sampling_params": {**GOOD["sampling_params"], rng.choice(fields[8:12]): rng.choice(VALUES)},
            }
        if route in SAFE:
            body["not_a_field"] = 1  # never valid: refused before anything changes
        bodies.append((route, json.dumps(body).encode()))
    return bodies


def test_fuzzed_requests_never_break_the_server_or_a_good_request(qwen3_engine):
    url = qwen3_engine.url
    status, text = post(url + "/generate", GOOD)
    assert status == 200
    baseline = json.loads(text)["output_ids"]
    bodies = bad_bodies(random.Random(0), 300)
    with cf.ThreadPoolExecutor(8) as pool:
        bad = [pool.submit(post, url + route, body) for route, body in bodies]
        good = [pool.submit(post, url + "/generate", GOOD) for _ in range(24)]
        answers = [(route, f.result()) for (route, _), f in zip(bodies, bad)]
        goods = [f.result() for f in good]
    server_errors = [(route, status, text[:200]) for route, (status, text) in answers if status >= 500]
    assert not server_errors, server_errors[:5]
    assert all(status == 200 and json.loads(text)["output_ids"] == baseline for status, text in goods)
    post(url + "/end_weight_update", {})  # a fuzzed begin may have opened a session
    status, text = post(url + "/generate", GOOD)
    assert status == 200 and json.loads(text)["output_ids"] == baseline
