"""One RL optimizer step on a trainer rank: the behaviour policy's logprobs, the KL reference's,
the off-policy gap between trainer and rollout logprobs, then the PPO update (`rl_step`).

`offpolicy/*` compares the trainer's logprobs now with the engine's at generation, so under
`max_staleness >= 1` it includes how far the policy moved since; the mismatch on the same weights
is the consistency probe's (`moe_rl.rl.consistency_probe`, docs/algorithm.md).

Every rank of the trainer world calls it with the same batch (it runs collectives); the Ray
actor (`moe_rl.rl.trainer_group.TrainerRank`) only forwards the call, and tests call it under
`parallel.world.spawn`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from moe_rl.algorithms import AlgorithmConfig, make_policy_loss, policy_metrics
from moe_rl.rollout.expert_load import load_metrics
from moe_rl.rollout.train_batch import RLBatch
from moe_rl.trace import TRACER

if TYPE_CHECKING:  # megatron-core loads only where a trainer runs, not in the driver
    from moe_rl.trainer.megatron_trainer import MegatronTrainer


def rl_step(
    trainer: MegatronTrainer,
    batch: RLBatch,
    algorithm: AlgorithmConfig,
    model_path: str | None = None,
    step: int = 1,
    before_update: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Old logprobs (behaviour policy, with R3 when configured), reference logprobs (kl_coef > 0),
    the off-policy gap, then one optimizer step per PPO mini-batch, all against these old
    logprobs (collective: every rank calls it with the same batch). Returns the step's metrics.
    With one mini-batch the old policy is the one being trained: the old logprobs come from the
    training forward itself (`train_step(keep_logprobs=True)`), not from a pass of their own.
    `model_path`: where the KL reference comes from unless algorithm.ref_model_path says.
    `step`: the RL step being trained (the logged step, version + 1); with R3 the routing-off
    forward runs when `no_replay_forward_due(step)`. `before_update`: run before the first
    optimizer step, on the weights the step began with (`MegatronTrainer.train_step`)."""
    mask = batch.loss_mask[:, 1:].bool()
    recompute = algorithm.num_mini_batches > 1
    metrics: dict[str, float] = {}
    if recompute:
        start = time.perf_counter()
        with TRACER.span("old logprobs"):
            old = trainer.forward_logprobs(batch.tensors())
        metrics["time/old_logprobs_s"] = time.perf_counter() - start
        metrics.update(_logprob_diff(old, batch, mask, "offpolicy/logprob_diff"))
        batch = dataclasses.replace(batch, old_logprobs=torch.cat([torch.zeros_like(old[:, :1]), old], dim=1))
    if algorithm.needs_reference:
        ref = _reference_logprobs(trainer, batch, algorithm, model_path, metrics)
        batch = dataclasses.replace(batch, ref_logprobs=ref)
    if no_replay_forward_due(trainer.config, step):
        start = time.perf_counter()
        with TRACER.span("routing-off forward"):
            natural, agreement = trainer.natural_forward(batch.tensors())
        metrics.update(_logprob_diff(natural, batch, mask, "offpolicy/logprob_diff_no_replay"))
        for layer, share in agreement.items():
            metrics[f"routing/agreement/layer{layer}"] = float(share)
        load = trainer.natural_load()
        metrics.update(load_metrics(list(load), np.stack([c.numpy() for c in load.values()]), "experts/trainer"))
        metrics["time/no_replay_forward_s"] = time.perf_counter() - start
    start = time.perf_counter()
    result = trainer.train_step(
        batch.tensors(),
        make_policy_loss(algorithm),
        algorithm.num_mini_batches,
        keep_logprobs=not recompute,
        before_update=before_update,
    )
    metrics["time/train_step_s"] = time.perf_counter() - start
    if not recompute:
        metrics.update(_logprob_diff(result.logprobs, batch, mask, "offpolicy/logprob_diff"))
    for key, value in policy_metrics(result.sums, result.num_tokens).items():
        # |old - rollout| spans versions under staleness: the off-policy gap, beside the others
        metrics[f"offpolicy/{key}" if key == "logprob_diff_abs" else f"policy/{key}"] = value
    if algorithm.needs_reference:
        metrics["loss/kl"] = metrics["policy/kl"]  # mean over the trained tokens
    metrics.update(
        {
            "train/grad_norm": result.grad_norm,
            "train/loss": result.loss,
            "train/tokens": result.num_tokens,
            "train/skipped": float(result.skipped),
        }
    )
    if result.mtp_loss is not None:
        metrics["train/mtp_loss"] = result.mtp_loss
    return metrics


def no_replay_forward_due(config, step: int) -> bool:
    """With R3, whether RL `step` runs the routing-off forward (`trainer.no_replay_forward_every`:
    steps N, 2N, ...; 0 = never). It costs one forward of the whole batch, with natural routing,
    recorded (`MegatronTrainer.natural_forward`: the logprobs, `routing/agreement` and the expert load
    of natural routing, `experts/trainer/*`)."""
    every = config.no_replay_forward_every
    return bool(config.routing_replay) and every > 0 and step % every == 0


def _reference_logprobs(
    trainer: MegatronTrainer, batch: RLBatch, algorithm: AlgorithmConfig, model_path: str | None, metrics: dict
) -> torch.Tensor:
    """The frozen reference's logprobs at the batch's token positions (built on first use: the
    initial policy, rebuilt from model.path or trainer.seed, so a resumed run gets the same)."""
    start = time.perf_counter()
    with TRACER.span("ref logprobs"):
        if trainer.reference is None:
            trainer.build_reference(algorithm.ref_model_path or model_path)
        ref = trainer.reference_logprobs(batch.tensors())
    metrics["time/ref_logprobs_s"] = time.perf_counter() - start
    return torch.cat([torch.zeros_like(ref[:, :1]), ref], dim=1)


def _logprob_diff(logprobs: torch.Tensor, batch: RLBatch, mask: torch.Tensor, name: str) -> dict[str, float]:
    """|trainer - rollout| logprob over the loss tokens (across versions under staleness): mean and max."""
    diff = (logprobs - batch.rollout_logprobs[:, 1:]).abs()[mask]
    if diff.numel() == 0:
        return {}
    return {f"{name}_mean": float(diff.mean()), f"{name}_max": float(diff.max())}
