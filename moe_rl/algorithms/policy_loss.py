"""The policy loss as a trainer `LossFn`: PPO-clip with off-policy weights and optional KL.

`make_policy_loss(config)` returns `loss_fn(logprobs, microbatch) -> (loss_sum, num_tokens,
report)`, the signature of `moe_rl.trainer.megatron_trainer.LossFn`. Every tensor is
[mb, L] and aligned with `logprobs` (column t is the prediction of token t + 1); each row is
one sequence (no packing). The microbatch carries:
- `loss_mask`: 1 on response tokens to train on;
- `advantages`: the sequence's advantage broadcast over its tokens (see advantages.py);
- `old_logprobs`: pi_old, recomputed by the trainer with the weights before this update;
  optional with one mini-batch (`num_mini_batches` 1): pi_old is then the policy being
  trained, and its logprobs, detached, stand in (the same values; `rl_step` skips the pass);
- `rollout_logprobs`: the engine's logprobs (required unless off_policy="none");
- `ref_logprobs`: the frozen reference model's (required when kl_coef > 0).

Per token t of sequence i, with mask m (loss_mask), off-policy weight
c_t (off_policy.py), ratio r_t and advantage A:
    loss_t = c_t * max(-A r_t, -A clip(r_t, 1 - clip_low, 1 + clip_high)) + kl_coef * kl_t
with dual-clip (`clip_ratio_c`), for A < 0 the max is further capped at -A clip_ratio_c.
grpo / dr_grpo: r_t = exp(logp_t - old_t). gspo: r_t has the value of the sequence ratio
s_i = exp(mean_{t in m} (logp_t - old_t)) and its gradient (GSPO-token form: equal to GSPO's
sequence objective when A and the off-policy weight c_t are constant over the sequence, as
they are for sequence-level corrections; with token-level TIS/IcePop weights it is the
token-weighted variant). Log-ratios are clamped to +-20 first (verl's bound): exp of a larger
one overflows to inf, and inf x a zero weight is a NaN gradient.

The trainer sums `loss_sum` over microbatches and DP ranks and divides by the summed
`num_tokens` (Megatron's calculate_per_token_loss), so `num_tokens` is each microbatch's
share of the normaliser:
- grpo:    loss_sum = sum_t m_t loss_t,       num_tokens = sum_t m_t  (token mean over the batch)
- dr_grpo: loss_sum = sum_t m_t loss_t,       num_tokens = dr_grpo_norm_len * rows; the total is
           dr_grpo_norm_len * global_batch_size, a constant whatever the response lengths
- gspo:    loss_sum = sum_i mean_{t in m} loss_t, num_tokens = sequences with a loss token
           (each sequence's token mean, averaged over sequences)

Report (all sums, so the trainer can add them over microbatches and ranks):
- `loss`, `pg_loss` (loss without the KL term): aggregated like loss_sum, mean = x / num_tokens;
- over the `tokens` in the loss (mean = x / tokens): `kl`, `clip_fraction` (clipped tokens),
  `dual_clip_fraction` (with clip_ratio_c: tokens it capped),
  `ratio` (r_t), `entropy_estimate` (-logp_t, a sampled estimate: the loss sees no logits),
  `logprob_diff_abs` (the RL step logs it as `offpolicy/logprob_diff_abs`) and the off-policy
  method's counts;
- `mis_masked_sequences` (mean = x / sequences);
- counts, kept as they are: `tokens`, `sequences` (with a loss token).
`policy_metrics(sums, num_tokens)` does those divisions. The max of |old - rollout| cannot be
summed and is not reported: the caller has both tensors and can take it.
"""

from __future__ import annotations

from functools import partial

import torch

from moe_rl.algorithms.config import AlgorithmConfig
from moe_rl.algorithms.off_policy import off_policy_weights

Report = dict[str, torch.Tensor]


def make_policy_loss(config: AlgorithmConfig):
    """The trainer loss function for `config` (see the module docstring)."""
    return partial(policy_loss, config=config)


def policy_loss(logprobs: torch.Tensor, microbatch: dict[str, torch.Tensor], *, config: AlgorithmConfig):
    _check_inputs(logprobs, microbatch, config)
    mask = microbatch["loss_mask"].bool()
    report: Report = {}
    maskf = mask.to(logprobs.dtype)
    # Padding and prompt columns may hold anything (even -inf): zero them before any exp.
    logp = torch.where(mask, logprobs, 0.0)
    old = torch.where(mask, microbatch.get("old_logprobs", logprobs).detach(), 0.0)
    advantages = microbatch["advantages"].to(logprobs.dtype)

    weight, off_report = off_policy_weights(old, microbatch.get("rollout_logprobs"), mask, config)
    ratio = _ratio(logp, old, mask, config)
    clipped_ratio = ratio.clamp(1 - config.clip_low, 1 + config.clip_high)
    unclipped_loss, clipped_loss = -advantages * ratio, -advantages * clipped_ratio
    ppo = torch.maximum(unclipped_loss, clipped_loss)
    if config.clip_ratio_c is not None:
        capped = torch.minimum(ppo, -advantages * config.clip_ratio_c)
        report["dual_clip_fraction"] = ((capped < ppo) & (advantages < 0) & mask).sum()
        ppo = torch.where(advantages < 0, capped, ppo)
    pg = weight * ppo
    token_loss = pg
    if config.kl_coef > 0:
        ref = torch.where(mask, microbatch["ref_logprobs"], 0.0)
        kl = kl_penalty(logp, ref, config.kl_estimator) * maskf
        token_loss = pg + config.kl_coef * kl
        report["kl"] = kl.detach().sum()

    loss_sum, num_tokens = _aggregate(token_loss, mask, config)
    report.update(off_report)
    report.update(
        loss=loss_sum.detach(),
        pg_loss=_aggregate(pg, mask, config)[0].detach(),
        tokens=mask.sum(),
        sequences=mask.any(dim=1).sum(),
        clip_fraction=((clipped_loss > unclipped_loss) & mask).sum(),
        ratio=(ratio.detach() * maskf).sum(),
        entropy_estimate=-(logp.detach() * maskf).sum(),
    )
    return loss_sum, num_tokens, report


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens (Schulman's k1 / k2 / k3;
    the formulas are in `AlgorithmConfig.kl_estimator`)."""
    if estimator == "k1":
        return logprobs - ref_logprobs
    if estimator in ("k2", "mse"):
        return 0.5 * (logprobs - ref_logprobs).square()
    log_ratio = ref_logprobs - logprobs
    if estimator == "low_var_kl":
        log_ratio = log_ratio.clamp(-20, 20)
    k3 = torch.exp(log_ratio) - log_ratio - 1
    return k3.clamp(-10, 10) if estimator == "low_var_kl" else k3


def policy_metrics(sums: dict[str, float], num_tokens: float) -> dict[str, float]:
    """Means from the summed report of one step (`StepResult.sums`, `StepResult.num_tokens`)."""
    counts = {"tokens", "sequences"}
    tokens, sequences = max(sums.get("tokens", 0.0), 1.0), max(sums.get("sequences", 0.0), 1.0)
    metrics = {}
    for key, value in sums.items():
        if key in ("loss", "pg_loss"):
            metrics[key] = value / max(num_tokens, 1.0)
        elif key in counts:
            metrics[key] = value
        elif key == "mis_masked_sequences":
            metrics[key] = value / sequences
        else:
            metrics[key] = value / tokens
    return metrics


LOG_RATIO_BOUND = 20.0  # exp(20) ~ 5e8: far past any clip, far from float32's overflow at ~88


def _ratio(logp, old, mask, config):
    if config.advantage_estimator != "gspo":
        return torch.exp((logp - old).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    tokens = mask.sum(dim=1, keepdim=True).clamp(min=1)
    sequence_log_ratio = ((logp - old).sum(dim=1, keepdim=True) / tokens).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    # value s_i on every token; gradient s_i * d logp_t (sg = stop-gradient)
    return torch.exp(sequence_log_ratio.detach() + logp - logp.detach())


def _aggregate(token_loss, mask, config):
    maskf = mask.to(token_loss.dtype)
    if config.advantage_estimator == "gspo":
        tokens = maskf.sum(dim=1)
        per_sequence = (token_loss * maskf).sum(dim=1) / tokens.clamp(min=1)
        return per_sequence.sum(), (tokens > 0).sum().to(torch.int)
    loss_sum = (token_loss * maskf).sum()
    if config.advantage_estimator == "dr_grpo":
        rows = mask.shape[0]
        return loss_sum, torch.tensor(config.dr_grpo_norm_len * rows, dtype=torch.int, device=mask.device)
    return loss_sum, mask.sum().to(torch.int)


def _check_inputs(logprobs, microbatch, config):
    needed = {"loss_mask": "the batch builder", "advantages": "advantages.py, per token"}
    if config.num_mini_batches > 1:
        needed["old_logprobs"] = "the trainer's recompute pass (num_mini_batches > 1)"
    if config.off_policy != "none":
        needed["rollout_logprobs"] = f"the engine (off_policy={config.off_policy!r})"
    if config.kl_coef > 0:
        needed["ref_logprobs"] = "the reference model (kl_coef > 0)"
    for key, source in needed.items():
        if key not in microbatch:
            raise ValueError(f"microbatch lacks {key!r}: add it [mb, L] from {source}")
    for key in (*needed, "old_logprobs", "rollout_logprobs"):
        if key in microbatch and microbatch[key].shape != logprobs.shape:
            raise ValueError(
                f"microbatch[{key!r}] has shape {tuple(microbatch[key].shape)}, logprobs has "
                f"{tuple(logprobs.shape)}: align every per-token tensor with logprobs"
            )
