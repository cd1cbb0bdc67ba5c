"""Pause modes in the middle of 8 concurrent generations, and single-request aborts."""

from __future__ import annotations

import asyncio
from unittest.mock import ANY

import numpy as np
import pytest

from moe_rl.engine.sampling import SamplingParams
from tests.engine.engine_helpers import (
    engine_load,
    load_reference,
    reference,
    run,
    wait_for_load,
    wait_until_decoding,
    with_client,
)

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

PROMPTS = [[(5 * i + 11 * j) % 256 for j in range(2 + i)] for i in range(8)]


def consistent(prompt, result):
    n = len(result.output_ids)
    assert len(result.logprobs) == n == len(result.weight_versions)
    if result.routed_experts is None:  # aborted before its prefill ran (a loaded machine): nothing computed
        assert n == 0 and result.finish_reason == "abort"
        return
    assert result.routed_experts.shape[0] == len(prompt) + n - 1


async def start_all(client, max_new_tokens):
    tasks = [
        asyncio.create_task(
            client.generate(
                p,
                SamplingParams(max_new_tokens=max_new_tokens, sampling_seed=i, ignore_eos=True),
                return_routed_experts=True,
            )
        )
        for i, p in enumerate(PROMPTS)
    ]
    await wait_until_decoding(client.url, len(PROMPTS))  # all 8 in the batch, past their prefill
    assert not any(t.done() for t in tasks), "a request finished before the pause: raise max_new_tokens"
    return tasks


def test_abort_returns_consistent_partial_outputs(qwen3_engine, qwen3_dir):
    async def go(client):
        tasks = await start_all(client, max_new_tokens=400)
        await client.pause_generation("abort")
        results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)
        await client.continue_generation()
        after = await client.generate(PROMPTS[0], SamplingParams(max_new_tokens=3, sampling_seed=0, ignore_eos=True))
        return results, after

    results, after = run(with_client(qwen3_engine.url, go))
    assert all(r.finish_reason == "abort" for r in results)
    assert any(0 < len(r.output_ids) < 400 for r in results)
    for prompt, result in zip(PROMPTS, results):
        consistent(prompt, result)
    model = load_reference(qwen3_dir)
    partial = [(p, r) for p, r in zip(PROMPTS, results) if r.output_ids][:2]
    assert partial
    for prompt, result in partial:  # partial outputs are real model outputs
        logprobs, routing = reference(model, prompt, result.output_ids)
        assert np.allclose(result.logprobs, logprobs, atol=1e-4)
        assert np.array_equal(result.routed_experts, routing.numpy())
    assert after.finish_reason == "length" and len(after.output_ids) == 3


def test_retract_and_in_place_continue_to_full_length(qwen3_engine, qwen3_dir):
    """Both modes finish every request at max_new_tokens, like an uninterrupted run, and the
    continued tokens still match the model (retract recomputes the KV cache)."""
    max_new = 200

    async def go(client, mode):
        tasks = await start_all(client, max_new_tokens=max_new)
        await client.pause_generation(mode)
        paused = await engine_load(client.url)  # the pause has run on the scheduler when it returns
        if mode == "retract":  # KV dropped, every request back in the queue
            assert paused["num_running_reqs"] == 0 and paused["num_waiting_reqs"] == 8, paused
        else:  # in place: still in the batch
            assert paused["num_running_reqs"] == 8, paused
        await asyncio.sleep(0.5)  # a window in which a paused engine must not step
        still = await engine_load(client.url)
        assert still == {**paused, "timestamp": ANY}, f"{mode}: the engine stepped while paused: {paused} -> {still}"
        assert not any(t.done() for t in tasks), f"{mode}: a request finished while paused"
        await client.continue_generation()
        # 8 x 200 tokens: minutes on a busy 2-core machine (a safety net, not a measurement)
        return await asyncio.wait_for(asyncio.gather(*tasks), timeout=300)

    async def uninterrupted(client):
        return await asyncio.gather(
            *(
                client.generate(
                    p,
                    SamplingParams(max_new_tokens=max_new, sampling_seed=i, ignore_eos=True),
                    return_routed_experts=True,
                )
                for i, p in enumerate(PROMPTS)
            )
        )

    baseline = run(with_client(qwen3_engine.url, uninterrupted))
    model = load_reference(qwen3_dir)
    for mode in ("retract", "in_place"):
        results = run(with_client(qwen3_engine.url, go, mode))
        assert [len(r.output_ids) for r in results] == [len(r.output_ids) for r in baseline] == [max_new] * 8
        for prompt, result in zip(PROMPTS, results):
            assert result.finish_reason == "length"
            consistent(prompt, result)
        logprobs, routing = reference(model, PROMPTS[7], results[7].output_ids)
        assert np.allclose(results[7].logprobs, logprobs, atol=1e-4), mode
        assert np.array_equal(results[7].routed_experts, routing.numpy()), mode


def test_abort_one_request_by_rid(qwen3_engine):
    async def go(client):
        long = asyncio.create_task(
            client.generate(
                PROMPTS[3],
                SamplingParams(max_new_tokens=400, ignore_eos=True),
                rid="victim",
                return_routed_experts=True,
            )
        )
        short = asyncio.create_task(client.generate(PROMPTS[4], SamplingParams(max_new_tokens=5, ignore_eos=True)))
        await short  # 5 tokens; then the victim, 400 tokens long, is the batch: let it decode 5 of its own
        await wait_for_load(
            client.url,
            lambda load: load["num_running_reqs"] == 1 and load["num_used_tokens"] >= len(PROMPTS[3]) + 5,
            "decoded 5 tokens of the victim",
        )
        await client.abort_request("victim")
        return await asyncio.wait_for(long, 10), await short

    long, short = run(with_client(qwen3_engine.url, go))
    assert long.finish_reason == "abort" and 5 <= len(long.output_ids) < 400
    consistent(PROMPTS[3], long)
    assert short.finish_reason == "length" and len(short.output_ids) == 5
