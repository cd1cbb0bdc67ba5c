"""Expert load (`moe_rl.rollout.expert_load`): counts from routing rows, the statistics against
hand-computed values, and the batch's load over its samples' real tokens only (no padding rows),
also in each trained sample's dump record."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moe_rl.algorithms import AlgorithmConfig
from moe_rl.rollout.dump import trained_records
from moe_rl.rollout.expert_load import MoELayers, load_metrics, read_expert_load, routed_counts, write_expert_load
from moe_rl.rollout.train_batch import build_batch
from moe_rl.sample import Sample


def test_counts_read_only_the_moe_layers():
    # 3 tokens, layer 0 dense (its rows hold zeros, as the engines fill them), layers 1-2 MoE, top-2
    routed = np.array(
        [
            [[0, 0], [1, 3], [2, 0]],
            [[0, 0], [1, 2], [2, 1]],
            [[0, 0], [3, 1], [2, 3]],
        ],
        dtype=np.uint8,
    )
    assert routed_counts(routed, [1, 2], num_experts=4).tolist() == [[0, 3, 1, 2], [1, 1, 3, 1]]


def test_statistics_of_balanced_skewed_and_empty_layers():
    metrics = load_metrics([1, 3, 5], np.array([[2, 2, 2, 2], [3, 1, 0, 0], [0, 0, 0, 0]]))
    # balanced: max share = mean share; entropy ln E
    assert metrics["experts/max_violation/layer1"] == 0.0
    assert metrics["experts/entropy/layer1"] == pytest.approx(math.log(4), abs=1e-12)
    # shares 3/4, 1/4, 0, 0: max / mean - 1 = 0.75 / 0.25 - 1; the empty experts add no entropy
    assert metrics["experts/max_violation/layer3"] == pytest.approx(2.0, abs=1e-12)
    assert metrics["experts/entropy/layer3"] == pytest.approx(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)))
    assert "experts/max_violation/layer5" not in metrics  # no routed slot: no statistic
    assert metrics["experts/max_violation_mean"] == pytest.approx(1.0)
    assert set(load_metrics([2], np.array([[1, 3]]), "experts/trainer")) == {
        "experts/trainer/max_violation/layer2",
        "experts/trainer/entropy/layer2",
        "experts/trainer/max_violation_mean",
    }


def _sample(prompt: list[int], response: list[int], routed: np.ndarray, gid: str) -> Sample:
    return Sample(
        prompt_ids=prompt,
        response_ids=response,
        rollout_logprobs=[-0.5] * len(response),
        loss_mask=[1] * len(response),
        weight_versions=[0] * len(response),
        routed_experts=routed,
        reward=float(len(response)),
        group_id=gid,
    )


def test_the_batch_load_counts_every_sample_token_and_no_padding(tmp_path):
    rng = np.random.default_rng(0)

    def routing(tokens: int) -> np.ndarray:  # 2 layers (layer 0 dense: zeros), top-2 of 4 distinct experts
        rows = np.stack([rng.permutation(4)[:2] for _ in range(tokens)])
        return np.stack([np.zeros_like(rows), rows], axis=1).astype(np.uint8)

    groups = [
        [_sample([1, 5], [7, 8, 9], routing(4), "a"), _sample([1, 5], [7], routing(2), "a")],
        [_sample([1, 6, 2], [4], routing(3), "b"), _sample([1, 6, 2], [3, 3], routing(4), "b")],
    ]
    moe = MoELayers((1,), 4)
    # rows padded to 8: the padding rows and the samples' padding columns hold experts 0, 1
    batch, info = build_batch(groups, AlgorithmConfig(), version=0, row_multiple=8, moe=moe)
    assert batch.routed_experts.shape[0] == 8
    expected = sum(np.bincount(s.routed_experts[:, 1].ravel(), minlength=4) for g in groups for s in g)
    assert expected.sum() == (4 + 2 + 3 + 4) * 2
    assert info.moe_layers == (1,) and info.expert_counts.tolist() == [expected.tolist()]
    share = expected / expected.sum()
    assert info.metrics()["experts/max_violation/layer1"] == pytest.approx(4 * share.max() - 1)
    # each trained record keeps its own sample's counts
    records = trained_records(1, groups, info, decode=str, trainer_version=0, moe=moe)
    assert [r["expert_load"] for r in records] == [moe.counts(s.routed_experts).tolist() for g in groups for s in g]
    assert sum(np.array(r["expert_load"]) for r in records).tolist() == info.expert_counts.tolist()
    # without MoE layers given (or routing), there is no load
    assert build_batch(groups, AlgorithmConfig(), version=0)[1].expert_counts is None
    # the per-step file the report draws
    write_expert_load(tmp_path, 1, info.moe_layers, info.expert_counts)
    write_expert_load(tmp_path, 2, info.moe_layers, info.expert_counts)
    rows = read_expert_load(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["counts"] == [expected.tolist()]


def test_dump_records_skip_the_load_of_large_models():
    big = MoELayers(tuple(range(48)), 128)  # Qwen3-30B-A3B: 6144 numbers per sample
    assert big.sample_counts(np.zeros((3, 48, 8), dtype=np.uint8)) is None
    assert MoELayers((0,), 4).sample_counts(None) is None
