"""Group advantages against hand-computed values (GRPO, Dr.GRPO, GSPO) and zero-variance groups."""

import math

import pytest
import torch

from moe_rl.algorithms import AlgorithmConfig, group_advantages, sample_advantages
from moe_rl.sample import Sample


def test_grpo_normalises_by_group_mean_and_unbiased_std():
    # group "a" = [1, 2, 6]: mean 3, deviations -2, -1, 3, unbiased var (4 + 1 + 9) / 2 = 7
    # group "b" = [0, 1]:    mean 0.5, deviations -0.5, 0.5, unbiased var 0.5
    result = group_advantages([1.0, 0.0, 2.0, 6.0, 1.0], ["a", "b", "a", "a", "b"], AlgorithmConfig())
    s7, s05 = math.sqrt(7), math.sqrt(0.5)
    expected = [-2 / s7, -0.5 / s05, -1 / s7, 3 / s7, 0.5 / s05]
    torch.testing.assert_close(result.advantages, torch.tensor(expected), atol=1e-5, rtol=1e-5)
    assert not result.zero_variance.any()


def test_gspo_uses_grpo_advantages():
    rewards, groups = [1.0, 0.0, 2.0, 6.0], ["a", "b", "a", "a"]
    grpo = group_advantages(rewards, groups, AlgorithmConfig())
    gspo = group_advantages(rewards, groups, AlgorithmConfig(advantage_estimator="gspo"))
    assert torch.equal(grpo.advantages, gspo.advantages)


def test_dr_grpo_only_centres():
    config = AlgorithmConfig(advantage_estimator="dr_grpo", dr_grpo_norm_len=8)
    result = group_advantages([1.0, 2.0, 6.0, 0.0, 1.0], ["a", "a", "a", "b", "b"], config)
    assert torch.equal(result.advantages, torch.tensor([-2.0, -1.0, 3.0, -0.5, 0.5]))


def test_zero_variance_groups_are_zero_and_flagged():
    rewards, groups = [0.1, 0.1, 0.1, 1.0, 0.0, 5.0], ["a", "a", "a", "b", "b", "c"]
    result = group_advantages(rewards, groups, AlgorithmConfig())
    # all-equal group "a" and single-sample group "c" carry no signal: exactly 0, flagged
    assert torch.equal(result.zero_variance, torch.tensor([True, True, True, False, False, True]))
    assert torch.equal(result.advantages[[0, 1, 2, 5]], torch.zeros(4))
    assert torch.equal(result.advantages[3:5], group_advantages([1.0, 0.0], ["b", "b"], AlgorithmConfig()).advantages)


def test_from_samples_and_bad_input():
    samples = [Sample(prompt_ids=[1], reward=r, group_id=g) for r, g in [(1.0, "p"), (0.0, "p")]]
    result = sample_advantages(samples, AlgorithmConfig(advantage_estimator="dr_grpo", dr_grpo_norm_len=4))
    assert torch.equal(result.advantages, torch.tensor([0.5, -0.5]))
    with pytest.raises(ValueError, match=r"samples\[1\]\.reward is None"):
        sample_advantages([samples[0], Sample(prompt_ids=[1], group_id="p")], AlgorithmConfig())
    with pytest.raises(ValueError, match=r"samples\[0\]\.group_id"):
        sample_advantages([Sample(prompt_ids=[1], reward=1.0)], AlgorithmConfig())
    with pytest.raises(ValueError, match="one reward and one group id"):
        group_advantages([1.0, 2.0], ["a"], AlgorithmConfig())
    with pytest.raises(ValueError, match="NaN"):
        group_advantages([float("nan"), 2.0], ["a", "a"], AlgorithmConfig())
