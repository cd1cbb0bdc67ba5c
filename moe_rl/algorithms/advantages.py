"""Group-relative advantages: one scalar per sample from the rewards of its group.

A group is the set of samples generated from the same prompt (`Sample.group_id`). For a group
with rewards r_1..r_G, mean m and unbiased (Bessel-corrected, as in verl and TRL) std s:
- grpo, gspo: A_i = (r_i - m) / (s + adv_eps)
- dr_grpo:    A_i = r_i - m
A group whose rewards are all equal (or that has one sample) has zero variance: every A_i is
exactly 0 and it carries no learning signal: in the batch it only adds tokens to the normaliser.
Such groups are flagged (`zero_variance`); leaving them out is the rollout's job
(`rollout.drop_zero_variance_groups` drops them at generation and starts a fresh prompt, so the
batch keeps its size). The per-token `advantages` tensor the loss reads is A_i broadcast
over sample i's response tokens; building it is the batch builder's job, from `token_advantages`.

On-policy distillation (`algorithm.distill`, docs/signals.md): with the teacher's logprob T_t and
the engine's (the student's) logprob S_t of each sampled response token t, the per-token reverse KL
estimate is k_t = S_t - T_t (KL(student || teacher) at the sampled token); b_g is the mean k_t over
the trained tokens of the sample's group, a baseline (as GRPO centres rewards on the group's mean:
the expected gradient is unchanged, its variance falls; without it every sampled token of a student
far from its teacher is pushed down hard, mostly noise). Then
- mode "pure": A_t = -coef * (k_t - b_g): the task reward is not trained on (a group of equal
  rewards still teaches: nothing is dropped for zero variance);
- mode "add":  A_t = A_i - coef * (k_t - b_g).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from moe_rl.algorithms.config import AlgorithmConfig, DistillConfig
from moe_rl.sample import Sample


@dataclass(frozen=True)
class GroupAdvantages:
    """Per-sample results, in the order of the input."""

    advantages: torch.Tensor
    """float32 [n]: the advantage of each sample."""
    zero_variance: torch.Tensor
    """bool [n]: the sample's group has all-equal rewards (or a single sample)."""


def group_advantages(
    rewards: torch.Tensor | Sequence[float], group_ids: Sequence[Hashable], config: AlgorithmConfig
) -> GroupAdvantages:
    """Advantages of `rewards` [n], where sample i belongs to group `group_ids[i]`."""
    rewards = torch.as_tensor(rewards, dtype=torch.float64)
    if rewards.ndim != 1 or rewards.numel() != len(group_ids):
        raise ValueError(
            f"rewards has shape {tuple(rewards.shape)} but there are {len(group_ids)} group ids: "
            "give one reward and one group id per sample"
        )
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contain NaN or inf: fix the reward function")
    advantages = torch.zeros_like(rewards)
    zero_variance = torch.zeros(rewards.numel(), dtype=torch.bool)
    for members in _groups(group_ids).values():
        index = torch.tensor(members)
        group = rewards[index]
        if group.numel() < 2 or bool((group == group[0]).all()):
            zero_variance[index] = True  # advantages stay exactly 0
            continue
        centred = group - group.mean()
        if config.advantage_estimator == "dr_grpo":
            advantages[index] = centred
        else:
            advantages[index] = centred / (group.std(unbiased=True) + config.adv_eps)
    return GroupAdvantages(advantages.to(torch.float32), zero_variance)


def sample_advantages(samples: Sequence[Sample], config: AlgorithmConfig) -> GroupAdvantages:
    """`group_advantages` from `Sample.reward` and `Sample.group_id`."""
    for i, sample in enumerate(samples):
        if sample.reward is None:
            raise ValueError(f"samples[{i}].reward is None: score every sample before advantages")
        if not sample.group_id:
            raise ValueError(f"samples[{i}].group_id is empty: give samples of one prompt one group id")
    return group_advantages([s.reward for s in samples], [s.group_id for s in samples], config)


def _groups(group_ids: Sequence[Hashable]) -> dict[Hashable, list[int]]:
    groups: dict[Hashable, list[int]] = {}
    for i, group_id in enumerate(group_ids):
        groups.setdefault(group_id, []).append(i)
    return groups


def token_advantages(
    sample: Sample, advantage: float, distill: DistillConfig | None, baseline: float = 0.0
) -> torch.Tensor:
    """float32 [response_len]: the advantage of each of `sample`'s response tokens, from its group
    advantage and, with distillation, the teacher's logprobs and its group's `kl_baseline`
    (module docstring)."""
    group = torch.full((len(sample.response_ids),), float(advantage))
    if distill is None:
        return group
    taught = -distill.coef * (reverse_kl(sample) - baseline)
    return taught if distill.mode == "pure" else group + taught


def reverse_kl(sample: Sample) -> torch.Tensor:
    """float32 [response_len]: k_t = student logprob - teacher logprob of each sampled token."""
    if sample.teacher_logprobs is None:
        raise ValueError(
            f"sample of group {sample.group_id!r} has no teacher_logprobs but algorithm.distill is set: "
            "the rollout scores every group with the teacher (moe_rl.signals.teacher)"
        )
    return torch.tensor(sample.rollout_logprobs, dtype=torch.float32) - torch.tensor(
        sample.teacher_logprobs, dtype=torch.float32
    )


def kl_baseline(group: Sequence[Sample]) -> float:
    """b_g: the mean k_t over the group's trained tokens (0 when it has none)."""
    values = [reverse_kl(s)[torch.tensor(s.loss_mask, dtype=torch.bool)] for s in group if s.response_ids]
    values = torch.cat(values) if values else torch.zeros(0)
    return float(values.mean()) if values.numel() else 0.0
