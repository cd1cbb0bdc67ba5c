"""build_batch: samples -> trainer tensors at the right positions (hand-built samples, exact checks)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_rl.algorithms import AlgorithmConfig
from moe_rl.rollout.train_batch import build_batch
from moe_rl.sample import Sample

LAYERS, TOPK = 2, 2


def sample(prompt, response, reward, gid, versions, routed=True):
    n = len(prompt) + len(response) - 1
    routing = np.arange(n * LAYERS * TOPK, dtype=np.int32).reshape(n, LAYERS, TOPK) % 4 if routed else None
    return Sample(
        prompt_ids=prompt,
        response_ids=response,
        rollout_logprobs=[-0.5 - i for i in range(len(response))],
        loss_mask=[1] * len(response),
        weight_versions=versions,
        routed_experts=routing,
        reward=reward,
        group_id=gid,
        segments=2 if len(set(versions)) > 1 else 1,
    )


def test_positions_advantages_staleness_and_routing():
    groups = [
        [sample([1, 5, 2], [7, 8], 1.0, "a", [3, 3]), sample([1, 5, 2], [9], 0.0, "a", [2])],
        [sample([1, 6, 2], [4, 4, 4], 0.5, "b", [1, 2, 3]), sample([1, 6, 2], [3], 0.5, "b", [3])],
    ]
    batch, info = build_batch(groups, AlgorithmConfig(), version=3, max_staleness=2)
    assert set(batch.tensors()) == {"tokens", "loss_mask", "advantages", "rollout_logprobs", "routed_experts"}
    assert batch.tokens.tolist() == [[1, 5, 2, 7, 8, 0], [1, 5, 2, 9, 0, 0], [1, 6, 2, 4, 4, 4], [1, 6, 2, 3, 0, 0]]
    assert batch.loss_mask.tolist() == [
        [0, 0, 0, 1, 1, 0],
        [0, 0, 0, 1, 0, 0],
        [0, 0, 0, 1, 1, 1],
        [0, 0, 0, 1, 0, 0],
    ]
    # group a: rewards 1, 0 -> (r - mean) / (unbiased std + eps) = +-0.5 / sqrt(0.5)
    a = 0.5 / (np.sqrt(0.5) + 1e-6)
    torch.testing.assert_close(batch.advantages[0, 3:5], torch.full((2,), a))
    torch.testing.assert_close(batch.advantages[1, 3], torch.tensor(-a, dtype=torch.float32))
    assert batch.advantages[2:].abs().sum() == 0  # zero-variance group b
    assert batch.rollout_logprobs[2].tolist() == [0, 0, 0, -0.5, -1.5, -2.5]
    routed = batch.routed_experts
    assert routed.shape == (4, 6, LAYERS, TOPK) and routed.dtype == torch.int32
    assert torch.equal(routed[0, :4], torch.from_numpy(groups[0][0].routed_experts))
    assert torch.equal(routed[1, 3:], torch.arange(TOPK, dtype=torch.int32).expand(3, LAYERS, TOPK))
    assert info.group_ids == ["a", "b"] and info.staleness == [0, 1, 2, 0] and info.segments == [1, 1, 2, 1]
    metrics = info.metrics()
    assert metrics["rollout/reward_mean"] == 0.5 and metrics["rollout/staleness_count/2"] == 1
    assert metrics["rollout/partial_samples"] == 1


def test_rows_past_the_buffer_bound_mean_a_wrong_version():
    # the buffer delivered these within max_staleness 1 at version 3; at version 4 one is 2 behind
    groups = [[sample([1, 2], [3, 4], 1.0, "a", [2, 3]), sample([1, 2], [5], 0.0, "a", [3])]]
    build_batch(groups, AlgorithmConfig(), 3, max_staleness=1)
    with pytest.raises(ValueError, match=r"group 'a'\) is 2 versions behind trainer version 4, past max_staleness=1"):
        build_batch(groups, AlgorithmConfig(), 4, max_staleness=1)
    assert build_batch(groups, AlgorithmConfig(), 4)[1].staleness == [2, 1]  # no bound given: none checked


def test_zero_variance_groups_stay_in_the_batch_and_mixed_routing_is_refused():
    # leaving them out is the rollout's job (rollout.drop_zero_variance_groups): here they keep
    # their tokens, with advantage 0 (only the normaliser sees them)
    groups = [[sample([1, 2], [3], 1.0, "a", [0]), sample([1, 2], [4], 1.0, "a", [0])]]
    batch, _ = build_batch(groups, AlgorithmConfig(), 0, 0)
    assert batch.loss_mask.tolist() == [[0, 0, 1], [0, 0, 1]] and batch.advantages.abs().sum() == 0
    mixed = [[sample([1, 2], [3], 1.0, "a", [0]), sample([1, 2], [4], 0.0, "a", [0], routed=False)]]
    with pytest.raises(ValueError, match="routed experts"):
        build_batch(mixed, AlgorithmConfig(), 0, 0)


@pytest.mark.parametrize("dtype", [np.uint8, np.int16])
def test_routing_keeps_the_samples_small_dtype(dtype):
    """Narrow routing (`routing_dtype`) stays narrow in the batch, filler rows included; a sample
    in int32 (an older record) widens the batch to int32, values unchanged."""
    groups = [[sample([1, 2], [3, 4], 1.0, "a", [0, 0]), sample([1, 2], [5], 0.0, "a", [0])]]
    for s in groups[0]:
        s.routed_experts = s.routed_experts.astype(dtype)
    routed = build_batch(groups, AlgorithmConfig(), 0)[0].routed_experts
    assert routed.dtype == torch.from_numpy(np.zeros(0, dtype)).dtype
    assert np.array_equal(routed[0, :3].numpy(), groups[0][0].routed_experts)
    assert routed[1, 2:].tolist() == [[[0, 1]] * LAYERS] * 2  # filler 0..topk-1
    groups[0][1].routed_experts = groups[0][1].routed_experts.astype(np.int32)
    wide = build_batch(groups, AlgorithmConfig(), 0)[0].routed_experts
    assert wide.dtype == torch.int32 and torch.equal(wide, routed.int())
