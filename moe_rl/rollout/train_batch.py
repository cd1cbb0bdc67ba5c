"""Scored groups of `Sample`s -> one `RLBatch`: the [B, S, ...] tensors of an RL step, by name.

Row i is sample i: tokens = prompt + response, right-padded with 0 to the longest row. Every
per-token tensor sits at the token's own position t (the trainer aligns column t + 1 of it with
the prediction of token t + 1):
- `loss_mask`: the sample's loss mask on its response positions, 0 elsewhere (the rollout has
  already zeroed tokens older than their sample's newest version when `rollout.mask_stale_tokens`);
- `advantages`: the sample's group advantage on its response positions (with `algorithm.distill`,
  per token: `moe_rl.algorithms.advantages.token_advantages`);
- `rollout_logprobs`: the engine's logprob of each response token;
- `routed_experts` (when the samples carry routing): [B, S, layers, topk] in the samples' dtype
  (uint8 / int16 by `moe_rl.sample.routing_dtype`; the widest when samples differ), row t = the
  experts token t was routed to; rows without routing (the last token, padding) hold the distinct
  experts 0..topk-1, so a replayed router never sees a duplicate index. The trainer widens it to
  Megatron's index dtype only where it hands rows to megatron-core (`trainer.routing_replay`).

An agent episode is a row like any sample: its environment tokens carry loss mask 0 (they are
context, not actions) and routed experts like the rest. An episode forked by a history edit
brings one row per sequence; the batch is then padded with empty rows (loss mask 0) to a
multiple of `row_multiple` (mini-batches x micro_batch_size x dp), which the trainer accepts.

`RLBatch.tensors()` is the dict the trainer splits into micro-batches
(`moe_rl.trainer.microbatches`); the policy loss reads each micro-batch's tensors under the field
names (`moe_rl.algorithms.policy_loss`), those `rl_step` adds (`old_logprobs`, `ref_logprobs`) included.

Filtering is the rollout's: the buffer delivers only groups whose stalest token is at most
`rollout.max_staleness` versions behind, and `rollout.drop_zero_variance_groups` drops groups
with all-equal rewards at generation. Every sample given here is a row with its own loss mask.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from moe_rl.algorithms import AlgorithmConfig, sample_advantages
from moe_rl.algorithms.advantages import kl_baseline, reverse_kl, token_advantages
from moe_rl.rollout import staleness
from moe_rl.rollout.expert_load import MoELayers, load_metrics
from moe_rl.sample import Sample
from moe_rl.tasks.mixture import TASK_METRICS


@dataclass(frozen=True, kw_only=True)
class RLBatch:
    """One RL step's rows, each [B, S, ...] with column t at token t (see the module docstring)."""

    tokens: torch.Tensor
    """int64 [B, S]: prompt + response, right-padded with 0."""
    loss_mask: torch.Tensor
    """int64 [B, S]: 1 on the response tokens trained on."""
    advantages: torch.Tensor
    """float32 [B, S]: each sample's advantage on its response tokens."""
    rollout_logprobs: torch.Tensor
    """float32 [B, S]: the engine's logprob of each response token."""
    routed_experts: torch.Tensor | None = None
    """[B, S, layers, topk] (uint8 / int16): the experts each token was routed to; None without R3."""
    old_logprobs: torch.Tensor | None = None
    """float32 [B, S]: the behaviour policy's logprobs, as the trainer recomputes them (`rl_step`)."""
    ref_logprobs: torch.Tensor | None = None
    """float32 [B, S]: the KL reference's logprobs (`rl_step`, with algorithm.kl_coef > 0)."""

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The set fields by name: what the trainer's micro-batching splits and the loss reads."""
        fields = (f.name for f in dataclasses.fields(self))
        return {name: getattr(self, name) for name in fields if getattr(self, name) is not None}

    def tensor_bytes(self) -> int:
        """Bytes of the tensors (`perf/batch_tensor_bytes`: what the driver no longer holds)."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


@dataclass
class BatchInfo:
    """What the loop logs about one batch."""

    group_ids: list[str]
    rewards: list[float]
    response_lengths: list[int]
    staleness: list[int]
    """Per sample: trainer version minus its oldest token's version."""
    segments: list[int]
    """Per sample: engine requests behind it (> 1 = continued across a weight swap)."""
    advantages: list[float] = field(default_factory=list)
    """Per sample: its advantage as trained (the value on its response tokens; with distillation,
    their mean over its trained tokens)."""
    reverse_kl: float | None = None
    """Distillation: the mean per-token reverse KL to the teacher over the trained tokens; else None."""
    teacher_s: float = 0.0
    """Distillation: seconds the batch's groups waited for their teacher calls, summed over groups."""
    trained_tokens: int = 0
    """Response tokens with loss mask 1."""
    masked_tokens: int = 0
    """Response tokens with loss mask 0 (environment tokens, masked stale tokens)."""
    padding_rows: int = 0
    tasks: list[str | None] = field(default_factory=list)
    """Per sample: its mixture task (`metadata["task"]`), None outside a mixture."""
    moe_layers: tuple[int, ...] = ()
    expert_counts: np.ndarray | None = None
    """int64 [MoE layers, experts]: the routed slots each expert got over every token the engines
    routed for these samples (`moe_rl.rollout.expert_load`); None without routing."""

    def metrics(self) -> dict[str, float]:
        counts = Counter(self.staleness)
        load = {} if self.expert_counts is None else load_metrics(list(self.moe_layers), self.expert_counts)
        per_task = {}
        for name in sorted({t for t in self.tasks if t is not None}):  # a mixture: each task's samples too
            per_task.update(self._sample_metrics(f"{TASK_METRICS}/{name}", [t == name for t in self.tasks]))
        return {
            **load,
            **self._sample_metrics("rollout", [True] * len(self.rewards)),
            "rollout/trained_tokens": self.trained_tokens,
            "rollout/masked_tokens": self.masked_tokens,
            "rollout/padding_rows": self.padding_rows,
            **{f"rollout/staleness_count/{k}": v for k, v in sorted(counts.items())},
            **per_task,
            **(
                {}
                if self.reverse_kl is None
                else {"distill/reverse_kl": self.reverse_kl, "time/teacher_s": self.teacher_s}
            ),
        }

    def _sample_metrics(self, prefix: str, chosen: list[bool]) -> dict[str, float]:
        """Means and maxima over the `chosen` samples, under `prefix`."""

        def pick(values: list) -> list:
            return [v for v, keep in zip(values, chosen) if keep]

        rewards, lengths, ages = pick(self.rewards), pick(self.response_lengths), pick(self.staleness)
        n = max(len(rewards), 1)
        return {
            f"{prefix}/reward_mean": sum(rewards) / n,
            f"{prefix}/reward_max": max(rewards, default=0.0),
            f"{prefix}/response_length_mean": sum(lengths) / n,
            f"{prefix}/response_length_max": max(lengths, default=0),
            f"{prefix}/staleness_mean": sum(ages) / n,
            f"{prefix}/staleness_max": max(ages, default=0),
            f"{prefix}/partial_samples": sum(s > 1 for s in pick(self.segments)),
            f"{prefix}/samples": len(rewards),
        }


def build_batch(
    groups: list[list[Sample]],
    algorithm: AlgorithmConfig,
    version: int,
    max_staleness: int | None = None,
    row_multiple: int = 1,
    moe: MoELayers | None = None,
) -> tuple[RLBatch, BatchInfo]:
    """The trainer batch of `groups` consumed at trainer `version`, and what to log about it;
    rows padded (loss mask 0) to a multiple of `row_multiple`. `moe`: the model's MoE layers, for
    the expert load of samples that carry routing (`BatchInfo.expert_counts`).

    `max_staleness`: the bound the buffer delivered `groups` under. A sample past it means
    `version` is not the version they were delivered at (the logged staleness would be wrong),
    and raises; it filters nothing."""
    samples = [s for group in groups for s in group]
    ages = [staleness(s, version) for s in samples]
    if max_staleness is not None and max(ages, default=0) > max_staleness:
        worst = ages.index(max(ages))
        raise ValueError(
            f"sample {worst} (group {samples[worst].group_id!r}) is {ages[worst]} versions behind "
            f"trainer version {version}, past max_staleness={max_staleness}: the buffer delivers "
            "only groups within the bound; pass the version the batch was delivered at"
        )
    advantages = sample_advantages(samples, algorithm)
    seq = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    rows = -(-len(samples) // row_multiple) * row_multiple
    tokens = torch.zeros(rows, seq, dtype=torch.long)
    loss_mask = torch.zeros(rows, seq, dtype=torch.long)
    adv = torch.zeros(rows, seq)
    rollout_lp = torch.zeros(rows, seq)
    routed = _routing_tensor(samples, rows, seq)
    trained_advantages, kl_sum = [], 0.0
    baselines = {g[0].group_id: kl_baseline(g) for g in groups} if algorithm.distill is not None else {}
    for i, sample in enumerate(samples):
        p, r = len(sample.prompt_ids), len(sample.response_ids)
        tokens[i, : p + r] = torch.tensor(sample.prompt_ids + sample.response_ids)
        advantage = float(advantages.advantages[i])
        if r == 0:
            trained_advantages.append(advantage)
            continue
        response = slice(p, p + r)
        mask = torch.tensor(sample.loss_mask)
        loss_mask[i, response] = mask
        adv[i, response] = token_advantages(sample, advantage, algorithm.distill, baselines.get(sample.group_id, 0.0))
        if algorithm.distill is not None:  # the value on its trained tokens, for the log and dumps
            trained = mask.bool()
            advantage = float(adv[i, response][trained].mean()) if trained.any() else 0.0
            kl_sum += float(reverse_kl(sample)[trained].sum())
        trained_advantages.append(advantage)
        rollout_lp[i, response] = torch.tensor(sample.rollout_logprobs)
        if routed is not None:
            routed[i, : p + r - 1] = torch.from_numpy(sample.routed_experts.astype(routed.numpy().dtype))
    batch = RLBatch(
        tokens=tokens, loss_mask=loss_mask, advantages=adv, rollout_logprobs=rollout_lp, routed_experts=routed
    )
    info = BatchInfo(
        group_ids=[g[0].group_id for g in groups],
        rewards=[float(s.reward) for s in samples],
        response_lengths=[len(s.response_ids) for s in samples],
        staleness=ages,
        segments=[s.segments for s in samples],
        advantages=trained_advantages,
        trained_tokens=sum(sum(s.loss_mask) for s in samples),
        masked_tokens=sum(len(s.loss_mask) - sum(s.loss_mask) for s in samples),
        padding_rows=rows - len(samples),
        tasks=[s.metadata.get("task") for s in samples],
    )
    if algorithm.distill is not None:
        info.reverse_kl = kl_sum / max(info.trained_tokens, 1)
        info.teacher_s = sum(group[0].metadata.get("teacher_s", 0.0) for group in groups)
    if moe is not None and routed is not None:
        info.moe_layers = moe.layers
        info.expert_counts = sum(moe.counts(s.routed_experts) for s in samples)
    return batch, info


def _routing_tensor(samples: list[Sample], rows: int, seq: int) -> torch.Tensor | None:
    with_routing = [s.routed_experts is not None for s in samples]
    if not any(with_routing):
        return None
    if not all(with_routing):
        raise ValueError(
            "some samples carry routed experts and some do not: an engine ignored "
            "return_routed_experts; routing replay needs every sample's routing"
        )
    _, layers, topk = samples[0].routed_experts.shape
    dtype = np.result_type(*(s.routed_experts.dtype for s in samples))
    filler = torch.arange(topk, dtype=torch.from_numpy(np.zeros(0, dtype)).dtype)
    return filler.expand(rows, seq, layers, topk).clone()
