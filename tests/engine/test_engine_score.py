"""Prefill-only scoring on the embedded engine (`EngineClient.score`, SGLang's `max_new_tokens=0` +
`logprob_start_len=0` route): the exact ids' logprobs and routed experts, equal to the engine's own
generation of the same tokens and to the transformers model, without harming requests that generate
beside it. SGLang's response shape is checked in tests/conformance/test_sglang_score.py.

Tolerance: the engine and the reference both compute in fp32 (unit roundoff u = 2^-24 ~ 6e-8); they
differ only in the order of sums (one batched, left-padded prefill or a KV-cached decode step against
one full forward). Each logprob is a logit minus a log-sum-exp over a vocabulary of 256, after 3
layers of dot products of length <= 128: a worst-case error of ~n u per dot product (128 u ~ 8e-6
relative), compounded over ~10 sequential products and normalised activations, stays under 1e-4,
the bound the engine's other reference tests use; measured gaps are ~1e-6.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from moe_rl.engine.sampling import SamplingParams
from tests.engine.engine_helpers import load_reference, reference, run, with_client
from tests.engine.test_engine_reference import PROMPTS
from tests.engine.test_engine_requests import post

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

ATOL = 1e-4  # fp32 sums in another order (module docstring)


def test_score_equals_the_engines_generation_and_transformers(qwen3_engine, qwen3_dir):
    """Score prompt + generated tokens while other requests generate in the same batches: the scored
    logprobs of the generated tokens equal the ones generation reported, every prompt token's
    logprob and every routing row equal the transformers forward, and the generating requests
    still match the reference token for token."""

    async def go(client):
        sampling = SamplingParams(max_new_tokens=8, sampling_seed=7, ignore_eos=True)
        first = await client.generate(PROMPTS[3], sampling, return_routed_experts=True)
        ids = PROMPTS[3] + first.output_ids
        others = [
            client.generate(p, SamplingParams(max_new_tokens=8, sampling_seed=i, ignore_eos=True))
            for i, p in enumerate(PROMPTS)
        ]
        *generated, scored = await asyncio.gather(*others, client.score(ids))
        return first, generated, scored, await client.model_info()

    first, generated, scored, info = run(with_client(qwen3_engine.url, go))
    ids = PROMPTS[3] + first.output_ids
    assert len(scored.logprobs) == len(ids) - 1 and scored.weight_version == int(info["weight_version"])
    assert np.allclose(scored.logprobs[len(PROMPTS[3]) - 1 :], first.logprobs, atol=ATOL, rtol=0)
    assert np.array_equal(scored.routed_experts, first.routed_experts)
    model = load_reference(qwen3_dir)
    logprobs, routing = reference(model, ids[:1], ids[1:])  # every token after the first
    assert np.allclose(scored.logprobs, logprobs, atol=ATOL, rtol=0)
    assert np.array_equal(scored.routed_experts, routing.numpy())
    for prompt, result in zip(PROMPTS, generated):
        assert len(result.output_ids) == 8
        assert np.allclose(result.logprobs, reference(model, prompt, result.output_ids)[0], atol=ATOL, rtol=0)


@pytest.mark.parametrize("start", [0, 3, 5])
def test_prompt_logprobs_follow_sglangs_layout(qwen3_engine, start):
    """From `logprob_start_len` on, one [logprob, id, None] per prompt token, the first logprob None
    (SGLang drops it even where it could compute it), none at len(input_ids); a prefill-only request
    finishes with finish reason length 0 and no output; generation with prompt logprobs still
    generates, and without logprob_start_len the list is empty."""
    ids = [3, 1, 4, 1, 5]
    body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": start}
    status, text = post(qwen3_engine.url + "/generate", body | {"sampling_params": {"max_new_tokens": 0}})
    assert status == 200, text
    meta = json.loads(text)["meta_info"]
    assert json.loads(text)["output_ids"] == [] and meta["output_token_logprobs"] == []
    assert meta["finish_reason"] == {"type": "length", "length": 0} and meta["completion_tokens"] == 0
    entries = meta["input_token_logprobs"]
    assert [entry[1] for entry in entries] == ids[start:]
    assert all(entry[2] is None for entry in entries) and (not entries or entries[0][0] is None)
    assert all(entry[0] < 0 for entry in entries[1:])
    status, text = post(qwen3_engine.url + "/generate", body | {"sampling_params": {"max_new_tokens": 2}})
    generated = json.loads(text)
    assert status == 200 and len(generated["output_ids"]) == 2
    assert generated["meta_info"]["input_token_logprobs"] == entries  # the same prefill's numbers
    status, text = post(qwen3_engine.url + "/generate", {"input_ids": ids, "return_logprob": True})
    assert status == 200 and json.loads(text)["meta_info"]["input_token_logprobs"] == []


def test_a_start_past_the_prompt_is_refused_naming_the_field(qwen3_engine):
    status, text = post(qwen3_engine.url + "/generate", {"input_ids": [1, 2], "logprob_start_len": 3})
    assert status == 400 and "logprob_start_len" in text, text
