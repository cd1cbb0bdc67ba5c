"""Off-policy correction: per-token loss weights from the trainer/rollout logprob gap.

Rollouts are sampled by the engine's policy mu (a possibly older weight version, and a
different kernel stack even at the same version); PPO's behaviour policy is the trainer's
pi_old (old logprobs recomputed by the trainer with the weights before the update). The
per-token ratio w_t = pi_old(y_t) / mu(y_t) = exp(old_logprob_t - rollout_logprob_t) corrects
for the gap. Every method returns a detached weight per token that multiplies the token's
policy-gradient loss; a weight of 0 masks the token (it stays in the loss normaliser, as in
the IcePop objective, so the gradient scale does not jump when tokens are masked).

Methods (written from the papers as I know them; the verl/slime sources were not reachable
while writing this, so the references are to the published definitions, not to their code):
- "tis", truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework Secretly
  Brings You Off-Policy RL Training"): weight = min(w_t, tis_cap).
- "icepop" (Ling team, Ring-1T report / "Small Leak Can Sink a Great Ship" blog, 2025):
  weight = w_t if icepop_low <= w_t <= icepop_high else 0 (their M(k) = k inside [alpha, beta]).
- "mis", sequence-level masked importance sampling in its geometric form (Liu, Li et al. 2025,
  "When Speed Kills Stability"; verl's geometric rejection): g_i = exp(mean_t log w_t) over
  the sequence's loss tokens; every token of sequence i gets weight 1 if mis_low <= g_i <=
  mis_high, else 0. Kept sequences are not re-weighted (a geometric mean is a mismatch
  detector, not an unbiased importance weight).
- "none": weight 1.
"""

from __future__ import annotations

import torch

from moe_rl.algorithms.config import AlgorithmConfig


def off_policy_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor | None,
    mask: torch.Tensor,
    config: AlgorithmConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weights [mb, L] (detached, 0 off `mask`) and report sums for one microbatch.

    Rows are sequences; `mask` (bool [mb, L]) selects the tokens in the loss. The report holds
    `logprob_diff_abs` (sum of |old - rollout| over tokens) whenever rollout logprobs are given,
    plus the method's own counts: tis_weight, tis_truncated | icepop_weight, icepop_masked |
    mis_masked_sequences, mis_masked_tokens.
    """
    maskf = mask.to(old_logprobs.dtype)
    if config.off_policy == "none" and rollout_logprobs is None:
        return maskf, {}
    with torch.no_grad():
        log_w = torch.where(mask, old_logprobs.detach() - rollout_logprobs, 0.0)
        report = {"logprob_diff_abs": log_w.abs().sum()}
        if config.off_policy == "none":
            return maskf, report
        if config.off_policy == "mis":
            return _sequence_mask(log_w, mask, config, report)
        w = torch.exp(log_w)
        if config.off_policy == "tis":
            weight = w.clamp(max=config.tis_cap) * maskf
            report["tis_weight"] = weight.sum()
            report["tis_truncated"] = ((w > config.tis_cap) & mask).sum()
        else:  # icepop
            inside = (w >= config.icepop_low) & (w <= config.icepop_high)
            weight = torch.where(inside & mask, w, 0.0)
            report["icepop_weight"] = weight.sum()
            report["icepop_masked"] = (~inside & mask).sum()
        return weight, report


def _sequence_mask(log_w, mask, config, report):
    tokens = mask.sum(dim=1)
    geometric = torch.exp(log_w.sum(dim=1) / tokens.clamp(min=1))
    keep = (geometric >= config.mis_low) & (geometric <= config.mis_high)
    weight = (keep[:, None] & mask).to(log_w.dtype)
    dropped = ~keep & (tokens > 0)
    report["mis_masked_sequences"] = dropped.sum()
    report["mis_masked_tokens"] = (tokens * dropped).sum()
    return weight, report
