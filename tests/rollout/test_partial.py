"""Partial rollouts: `continue_sample` alone, then abort-pause + weight swap + resume on a real engine."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from moe_rl.engine.client import GenerateResult
from moe_rl.rollout import RolloutConfig, RolloutManager, continue_sample
from moe_rl.rollout.partial import continuation_request, mask_older_tokens
from moe_rl.sample import Sample
from tests.engine.engine_helpers import wait_until_decoding
from tests.rollout.rollout_helpers import cancel, make_pool, reference, swap_weights

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)


def result(tokens, version, routed_rows, finish="length", layers=2, topk=2, first=0):
    routed = None
    if routed_rows is not None:
        routed = np.arange(first, first + routed_rows * layers * topk, dtype=np.int32).reshape(-1, layers, topk)
    return GenerateResult(
        rid="r",
        output_ids=list(tokens),
        logprobs=[-0.5 - t for t in tokens],
        finish_reason=finish,
        weight_version=version,
        weight_versions=[version] * len(tokens),
        routed_experts=routed,
        meta_info={},
    )


def test_continuation_keeps_narrow_routing():
    """Segments decoded as uint8 (`routing_dtype`) concatenate as uint8, rows unchanged."""
    first = result([7, 8], 0, routed_rows=4, finish="abort")
    first.routed_experts = first.routed_experts.astype(np.uint8)
    sample = continue_sample(Sample(prompt_ids=[1, 2, 3]), first, routed_experts=True)
    more = result([9], 1, routed_rows=1, first=200)
    more.routed_experts = more.routed_experts.astype(np.uint8)
    done = continue_sample(sample, more, routed_experts=True)
    assert done.routed_experts.dtype == np.uint8
    assert done.routed_experts.ravel().tolist() == [*range(16), 200, 201, 202, 203]


def test_continue_sample_concatenates_every_field_in_order():
    prompt = [1, 2, 3]
    sample = continue_sample(
        Sample(prompt_ids=prompt), result([7, 8], 0, routed_rows=3 + 2 - 1, finish="abort"), routed_experts=True
    )
    assert sample.status == "aborted" and sample.routed_experts.shape == (4, 2, 2)
    ids, start = continuation_request(sample)
    assert ids == [1, 2, 3, 7, 8] and start == 4  # the engine returns rows from position P + n - 1
    done = continue_sample(sample, result([9, 10, 11], 1, routed_rows=5 + 3 - 1 - 4, first=1000), routed_experts=True)
    assert done.response_ids == [7, 8, 9, 10, 11]
    assert done.rollout_logprobs == [-7.5, -8.5, -9.5, -10.5, -11.5]
    assert done.weight_versions == [0, 0, 1, 1, 1] and done.loss_mask == [1] * 5
    assert done.routed_experts.shape == (3 + 5 - 1, 2, 2)
    assert np.array_equal(done.routed_experts[:4], sample.routed_experts)
    assert done.routed_experts[4, 0, 0] == 1000 and done.status == "truncated"
    assert done.segments == 2
    assert mask_older_tokens(done).loss_mask == [0, 0, 1, 1, 1]


def test_continue_sample_edge_cases():
    empty = continue_sample(
        Sample(prompt_ids=[1, 2]), result([], 0, routed_rows=None, finish="abort"), routed_experts=True
    )
    assert empty.response_ids == [] and empty.routed_experts is None and continuation_request(empty) == ([1, 2], 0)
    first = continue_sample(empty, result([5], 1, routed_rows=2, finish="stop"), routed_experts=True)
    assert first.response_ids == [5] and first.routed_experts.shape == (2, 2, 2) and first.status == "completed"
    partial = continue_sample(
        Sample(prompt_ids=[1, 2]), result([5], 0, routed_rows=2, finish="abort"), routed_experts=True
    )
    with pytest.raises(ValueError, match="routed_experts_start_len"):  # engine sent all rows again
        continue_sample(partial, result([6], 1, routed_rows=3), routed_experts=True)
    unrouted = continue_sample(Sample(prompt_ids=[1, 2]), result([5, 6], 0, routed_rows=None), routed_experts=False)
    assert unrouted.routed_experts is None and unrouted.response_ids == [5, 6]


def test_every_resumed_segment_brings_its_routed_expert_rows():
    prompt = [1, 2, 3]
    partial = continue_sample(
        Sample(prompt_ids=prompt, group_id="g1"),
        result([7, 8], 0, routed_rows=4, finish="abort"),
        routed_experts=True,
    )
    # aborted while still queued: no tokens and, as SGLang answers, no routed_experts; nothing is missing
    queued = continue_sample(partial, result([], 1, routed_rows=None, finish="abort"), routed_experts=True)
    assert queued.response_ids == [7, 8] and np.array_equal(queued.routed_experts, partial.routed_experts)
    assert continuation_request(queued) == continuation_request(partial)  # the next continuation asks for the same rows
    done = continue_sample(queued, result([9], 1, routed_rows=1, finish="stop"), routed_experts=True)
    assert done.routed_experts.shape == (3 + 3 - 1, 2, 2)
    # tokens without their rows: an error naming the sample and the segment
    with pytest.raises(ValueError, match=r"group 'g1', segment 3 \(engine request r\): 1 tokens but no routed_experts"):
        continue_sample(queued, result([9], 1, routed_rows=None), routed_experts=True)
    with pytest.raises(ValueError, match=r"group 'g1', segment 3 .*2 rows, expected 1"):
        continue_sample(queued, result([9], 1, routed_rows=2), routed_experts=True)
    # a first segment whose tokens came without rows cannot be completed by later segments
    lost = continue_sample(
        Sample(prompt_ids=prompt, group_id="g2"),
        result([7], 0, routed_rows=None, finish="abort"),
        routed_experts=False,
    )
    with pytest.raises(ValueError, match=r"group 'g2', segment 2 .*earlier segments' 1 tokens have no routed experts"):
        continue_sample(lost, result([8], 1, routed_rows=1), routed_experts=True)


def test_abort_pause_swap_resume_keeps_tokens_logprobs_routing_versions(engine, model_dirs):
    """Cut 16 requests mid-generation, load other weights as version 1, resume: each sample is its
    segments' engine outputs concatenated, each segment matches transformers under its weights."""
    config = RolloutConfig(
        groups_per_step=2,
        n_samples_per_prompt=4,
        max_new_tokens=300,
        max_staleness=1,
        mask_stale_tokens=True,
        task_options={"length": 3},
    )

    async def go():
        pool = make_pool(engine.url, recording=True)
        manager = RolloutManager(config, pool)
        run = asyncio.create_task(manager.run())
        # rounds 0 and 1 (staleness 1): 2 x 2 groups x 4 samples in the batch, decoding under v0
        await wait_until_decoding(engine.url, 16)
        await swap_weights(pool, model_dirs[1], version=1)
        await manager.buffer.set_version(1)
        batch = await manager.buffer.get_batch(2)
        await cancel(run)
        await pool.close()
        manager.close()
        return batch, pool.calls, manager

    batch, calls, manager = asyncio.run(go())
    samples = [s for group in batch for s in group]
    assert manager.continued_requests >= 8
    cut = [s for s in samples if s.segments == 2]
    assert cut, "no request was cut by the pause: raise max_new_tokens"
    by_rid = {res.rid: (ids, kwargs, res) for ids, kwargs, res in calls}
    for sample in samples:
        assert len(sample.response_ids) == config.max_new_tokens and sample.status == "truncated"
        segments = [by_rid[rid] for rid in sample.request_ids]  # the engine requests behind it
        done = list(sample.prompt_ids)
        for ids, kwargs, res in segments:  # each resumes exactly where the previous one stopped
            assert ids == done and kwargs["max_new_tokens"] == config.max_new_tokens - (
                len(ids) - len(sample.prompt_ids)
            )
            assert kwargs["routed_experts_start_len"] == (
                len(ids) - 1 if len(segments) > 1 and ids is not segments[0][0] else 0
            )
            done += res.output_ids
        assert done == sample.prompt_ids + sample.response_ids  # no token lost or duplicated
        assert sample.rollout_logprobs == [lp for _, _, r in segments for lp in r.logprobs]
        assert sample.weight_versions == [v for _, _, r in segments for v in r.weight_versions]
        assert np.array_equal(sample.routed_experts, np.concatenate([r.routed_experts for _, _, r in segments]))
    for sample in cut[:2]:  # each segment is the model it ran under: logprobs and routing
        (ids0, _, first), (ids1, kwargs, second) = [by_rid[rid] for rid in sample.request_ids]
        start = kwargs["routed_experts_start_len"]
        assert set(first.weight_versions) == {0} and set(second.weight_versions) == {1}
        assert sample.loss_mask == [0] * len(first.output_ids) + [1] * len(second.output_ids)
        full = sample.prompt_ids + sample.response_ids
        for model_dir, ids, res, rows in (
            (model_dirs[0], ids0, first, slice(0, start)),
            (model_dirs[1], ids1, second, slice(start, len(full) - 1)),
        ):
            logprobs, routing = reference(model_dir, ids + res.output_ids)
            expected = [float(logprobs[len(ids) - 1 + i, t]) for i, t in enumerate(res.output_ids)]
            assert np.allclose(res.logprobs, expected, atol=1e-4)
            assert np.array_equal(sample.routed_experts[rows], routing[rows].numpy())


def test_restart_mode_discards_partial_tokens(engine, model_dirs):
    """partial_rollout=False: a cut request starts over from its prompt under the new weights."""
    config = RolloutConfig(
        groups_per_step=1, n_samples_per_prompt=4, max_new_tokens=500, max_staleness=0, partial_rollout=False
    )

    async def go():
        pool = make_pool(engine.url)
        manager = RolloutManager(config, pool, version=2)
        await swap_weights(pool, model_dirs[0], version=2, mode="in_place")
        run = asyncio.create_task(manager.run())
        await wait_until_decoding(engine.url, 4)  # the round's 4 samples, decoding under v2
        await swap_weights(pool, model_dirs[1], version=3)
        await manager.buffer.set_version(3)
        batch = await manager.buffer.get_batch(1)
        await cancel(run)
        await pool.close()
        manager.close()
        return batch, manager

    batch, manager = asyncio.run(go())
    assert manager.continued_requests >= 1 and manager.discarded_tokens > 0
    for sample in batch[0]:  # a cut sample restarted; one that finished under v2 was stale (bound 0)
        assert sample.weight_versions == [3] * config.max_new_tokens and sample.segments == 1
