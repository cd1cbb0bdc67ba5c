"""The consistency probe: train/inference mismatch measured on the same weights and the same tokens.

`offpolicy/logprob_diff_*` compares the engine's rollout logprobs with the trainer's old logprobs;
under `max_staleness >= 1` most tokens come from an older version, so it mostly measures how far the
policy moved. The probe takes the policy's movement out (docs/algorithm.md). Every
`trainer.consistency_probe_every` RL steps, after the weight sync (engines and trainer then hold
the same version until the next step's optimizer step):
  1. the rollout worker, building the step's batch, keeps the ids of
     `trainer.consistency_probe_samples` of its sequences (rows with trained tokens, evenly spaced;
     `probe_ids`; the driver holds only these); after the sync an engine scores each as it is: a
     prefill-only `/generate` of the exact ids (`EngineClient.score`: prompt logprobs and routed
     experts, its own request, beside the rollout's), the route a served teacher answers too;
  2. an engine answering with another weight version (with LoRA: without the version's adapter)
     skips the probe (`consistency/probe/skipped`): it never compares across versions;
  3. the trainer runs the same ids, replaying the engine's routing with `trainer.routing_replay`,
     and again with natural routing, recorded, for the routing agreement: inside the next step,
     between its forward-backward and its first optimizer step (the engine scores meanwhile), or
     at once when no next step follows in the same start or engines are colocated;
  4. it logs `consistency/probe/logprob_diff_mean` and `_max` (|engine - trainer| over every scored
     token: each token after the first of each sequence), `logprob_diff_no_replay_mean` and
     `routing_agreement` (trainer natural top-k vs the engine's, over those tokens of MoE layers),
     and the probe's cost to the trainer, `time/consistency_probe_s`.
The driver runs the steps in order (`moe_rl.jobs.rl`); the rollout worker does 1-2 (`probe_ids`,
`score_rows`), every trainer rank 3-4 (`compare`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from moe_rl.engine.client import EngineError
from moe_rl.engine.pool import EnginePool
from moe_rl.rollout.train_batch import RLBatch
from moe_rl.trainer.microbatches import row_lengths

if TYPE_CHECKING:  # megatron-core loads only where a trainer runs, not in the rollout worker
    from moe_rl.trainer.megatron_trainer import MegatronTrainer

PROBE_PREFIX = "consistency/probe/"
PROBE_TIME = "time/consistency_probe_s"


@dataclass(frozen=True)
class ProbeRequest:
    """`RolloutWorker.score_probe`: under which version to score the probe's ids, and how."""

    version: int
    """The trainer's version, which the engines serve since the sync."""
    routing: bool = True
    """Ask for the routed experts (trainer.routing_replay: the trainer replays them)."""
    lora_path: str | None = None
    """With LoRA: the adapter of `version` (`policy-v{version}`)."""


@dataclass(frozen=True)
class ProbeBatch:
    """The probed sequences as the trainer takes them, [P, S, ...] with column t at token t."""

    tokens: torch.Tensor
    """int64 [P, S]: each probed row's ids, right-padded with 0."""
    loss_mask: torch.Tensor
    """int64 [P, S]: 1 on every scored token (positions 1..len - 1 of the row)."""
    routed_experts: torch.Tensor | None
    """[P, S, layers, topk]: the engine's routing of each token but the last, experts 0..topk-1
    elsewhere; None when not asked for."""
    engine_logprobs: torch.Tensor
    """float32 [P, S]: the engine's logprob of each scored token."""


def probe_due(every: int, step: int) -> bool:
    """Whether RL `step` (the logged step, version + 1) runs the probe (steps N, 2N, ...; 0 = never)."""
    return every > 0 and step % every == 0


# -- 1, 2: the rollout worker's side ------------------------------------------------------------


def probe_ids(batch: RLBatch, samples: int) -> list[list[int]]:
    """The ids of `samples` of `batch`'s rows with trained tokens, evenly spaced (all of them when
    fewer), each up to its last real token (`row_lengths`)."""
    trained = (batch.loss_mask.sum(dim=1) > 0).nonzero().flatten().tolist()
    rows = [trained[i * len(trained) // samples] for i in range(min(samples, len(trained)))]
    lengths = row_lengths({"tokens": batch.tokens[rows], "loss_mask": batch.loss_mask[rows]}) if rows else []
    return [batch.tokens[row, :length].tolist() for row, length in zip(rows, lengths)]


async def score_rows(pool: EnginePool, ids: list[list[int]], request: ProbeRequest) -> ProbeBatch | str:
    """Score each of `ids` on the engines (concurrently, each its own request); the probe batch, or
    why it is skipped."""
    if not ids:
        return "the batch has no trained tokens"
    try:
        scores = await asyncio.gather(
            *(
                pool.score(row_ids, return_routed_experts=request.routing, lora_path=request.lora_path)
                for row_ids in ids
            )
        )
    except EngineError as error:
        return f"an engine failed to score: {error}"
    # with LoRA the adapter named is the version (an engine without it refuses the request), and
    # engines label only their base weights
    versions = sorted({request.version if request.lora_path else score.weight_version for score in scores})
    if versions != [request.version]:
        return f"engines served versions {versions} where the trainer holds {request.version}"
    count, width = len(ids), max(len(row_ids) for row_ids in ids)
    tokens = torch.zeros(count, width, dtype=torch.long)
    mask = torch.zeros(count, width, dtype=torch.long)
    engine = torch.zeros(count, width)
    for row, (row_ids, score) in enumerate(zip(ids, scores)):
        tokens[row, : len(row_ids)] = torch.tensor(row_ids)
        mask[row, 1 : len(row_ids)] = 1
        engine[row, 1 : len(row_ids)] = torch.tensor(score.logprobs)
    routed = _routing(scores, width) if request.routing else None
    return ProbeBatch(tokens=tokens, loss_mask=mask, routed_experts=routed, engine_logprobs=engine)


def _routing(scores: list, width: int) -> torch.Tensor:
    """[P, width, layers, topk] int64: each score's rows (every token but the last), experts
    0..topk-1 in the rest (a replayed router never sees a duplicate)."""
    layers, topk = scores[0].routed_experts.shape[1:]
    routed = torch.arange(topk).expand(len(scores), width, layers, topk).clone()
    for row, score in enumerate(scores):
        routed[row, : score.routed_experts.shape[0]] = torch.from_numpy(score.routed_experts.astype(np.int64))
    return routed


# -- 3, 4: the trainer ranks' side --------------------------------------------------------------


def compare(trainer: MegatronTrainer, probe: ProbeBatch) -> dict[str, float]:
    """The trainer's forward of the probed ids against the engine's scores (collective: every rank
    calls it with the same probe). Rows are padded (loss mask 0) to a multiple of dp."""
    batch = _padded(trainer, probe)
    rows = batch["tokens"].shape[0]
    mask = batch["loss_mask"][:, 1:].bool()
    engine = torch.zeros(rows, batch["tokens"].shape[1] - 1)
    engine[: probe.tokens.shape[0]] = probe.engine_logprobs[:, 1:]
    replay = trainer.routing is not None and probe.routed_experts is not None
    logprobs = trainer.forward_logprobs(batch, replay=replay, rows=rows)
    diff = (logprobs - engine).abs()[mask]
    metrics = {
        f"{PROBE_PREFIX}logprob_diff_mean": float(diff.mean()),
        f"{PROBE_PREFIX}logprob_diff_max": float(diff.max()),
    }
    if replay:  # natural routing, recorded against the engine's (R3's routers record)
        natural, agreement = trainer.natural_forward(batch, rows=rows)
        metrics[f"{PROBE_PREFIX}logprob_diff_no_replay_mean"] = float((natural - engine).abs()[mask].mean())
        # every MoE layer counts the same tokens: the mean over layers is the mean over decisions
        metrics[f"{PROBE_PREFIX}routing_agreement"] = sum(agreement.values()) / len(agreement)
    metrics[f"{PROBE_PREFIX}tokens"] = float(mask.sum())
    metrics[f"{PROBE_PREFIX}skipped"] = 0.0
    return metrics


def skipped_probe() -> dict[str, float]:
    """The metrics of a probe the engines could not answer on the trainer's version."""
    return {f"{PROBE_PREFIX}skipped": 1.0}


def probe_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """The probe's entries of a train step's metrics (`consistency/probe/*` and its cost), taken
    out of them: they belong to the row of the step whose version was probed."""
    names = [name for name in metrics if name.startswith(PROBE_PREFIX) or name == PROBE_TIME]
    return {name: metrics.pop(name) for name in names}


def _padded(trainer: MegatronTrainer, probe: ProbeBatch) -> dict[str, torch.Tensor]:
    """The probe as a trainer batch the schedule can split: a multiple of dp rows (each DP rank then
    runs its few rows as one micro-batch), or any count with token-budget micro-batches."""
    _, dp = trainer.dp_rank_and_size()
    unit = 1 if trainer.config.max_tokens_per_microbatch is not None else dp
    extra = -probe.tokens.shape[0] % unit
    batch = {
        "tokens": torch.cat([probe.tokens, probe.tokens.new_zeros(extra, probe.tokens.shape[1])]),
        "loss_mask": torch.cat([probe.loss_mask, probe.loss_mask.new_zeros(extra, probe.loss_mask.shape[1])]),
    }
    if probe.routed_experts is not None:  # padding rows route to experts 0..topk-1 (never replayed: not real)
        routed = probe.routed_experts
        filler = torch.arange(routed.shape[-1]).expand(extra, *routed.shape[1:])
        batch["routed_experts"] = torch.cat([routed, filler])
    return batch
