"""Policy loss against hand-computed cases: PPO clip (both sides, asymmetric), GRPO / Dr.GRPO /
GSPO aggregation, KL estimators, loss-mask holes, gradient sign, microbatch invariance."""

import math

import pytest
import torch

from moe_rl.algorithms import AlgorithmConfig, group_advantages, make_policy_loss, policy_metrics
from moe_rl.algorithms.policy_loss import kl_penalty

OLD_P = 0.5  # pi_old of every token; a token's ratio r gives logprob log(0.5 r)


def clip_case():
    """4 sequences x 3 columns (column 0 = prompt, masked). Ratios and advantages:
    row 0, A=+1: 1.1 (inside), 1.5 (above 1 + clip_high: clipped)
    row 1, A=-1: 0.85,         0.5 (below 1 - clip_low: clipped)
    row 2, A=+1: 0.5 (A > 0 is never clipped below), then a masked column
    row 3, A=-1: 1.5 (A < 0 is never clipped above), then a masked column
    """
    ratios = torch.tensor([[1.0, 1.1, 1.5], [1.0, 0.85, 0.5], [1.0, 0.5, 1.0], [1.0, 1.5, 1.0]])
    logprobs = torch.log(OLD_P * ratios).requires_grad_(True)
    microbatch = {
        "loss_mask": torch.tensor([[0, 1, 1], [0, 1, 1], [0, 1, 0], [0, 1, 0]]),
        "advantages": torch.tensor([[1.0] * 3, [-1.0] * 3, [1.0] * 3, [-1.0] * 3]),
        "old_logprobs": torch.full((4, 3), math.log(OLD_P)),
    }
    return logprobs, microbatch


def run(config, logprobs, microbatch):
    loss_sum, num_tokens, report = make_policy_loss(config)(logprobs, microbatch)
    (loss_sum / num_tokens).backward()
    return loss_sum.item(), int(num_tokens), {k: float(v) for k, v in report.items()}


def test_grpo_ppo_clip_both_sides():
    logprobs, microbatch = clip_case()
    loss, tokens, report = run(AlgorithmConfig(off_policy="none"), logprobs, microbatch)
    # per token max(-A r, -A clip(r, 0.8, 1.2)): -1.1, -1.2 | 0.85, 0.8 | -0.5 | 1.5
    assert loss == pytest.approx(-1.1 - 1.2 + 0.85 + 0.8 - 0.5 + 1.5)
    assert tokens == 6 and report["tokens"] == 6 and report["sequences"] == 4
    assert report["clip_fraction"] == 2 and report["pg_loss"] == pytest.approx(loss)
    # d(loss/6)/d logp = -A r / 6 where unclipped, 0 where clipped
    expected = torch.tensor([[0, -1.1, 0], [0, 0.85, 0], [0, -0.5, 0], [0, 1.5, 0]]) / 6
    torch.testing.assert_close(logprobs.grad, expected)


def test_asymmetric_clip_higher():
    logprobs, microbatch = clip_case()
    config = AlgorithmConfig(off_policy="none", clip_low=0.1, clip_high=0.3)
    loss, _, report = run(config, logprobs, microbatch)
    # clip range [0.9, 1.3]: -1.1, -1.3 | 0.9, 0.9 | -0.5 | 1.5
    assert loss == pytest.approx(-1.1 - 1.3 + 0.9 + 0.9 - 0.5 + 1.5)
    assert report["clip_fraction"] == 3


def test_dual_clip_caps_negative_advantages_only():
    """clip_ratio_c=1.4: row 3 (A=-1, r=1.5) would cost 1.5; capped at 1.4 and its gradient is 0.
    Positive advantages (row 0's r=1.5 is clipped at 1.2 anyway) are untouched."""
    logprobs, microbatch = clip_case()
    loss, _, report = run(AlgorithmConfig(off_policy="none", clip_ratio_c=1.4), logprobs, microbatch)
    assert loss == pytest.approx(-1.1 - 1.2 + 0.85 + 0.8 - 0.5 + 1.4)
    assert report["dual_clip_fraction"] == 1
    expected = torch.tensor([[0, -1.1, 0], [0, 0.85, 0], [0, -0.5, 0], [0, 0, 0]]) / 6
    torch.testing.assert_close(logprobs.grad, expected)
    with pytest.raises(ValueError, match="clip_ratio_c=1.0: must be > 1"):
        AlgorithmConfig(clip_ratio_c=1.0)


@pytest.mark.parametrize("estimator", ["grpo", "gspo"])
def test_an_exploded_log_ratio_gives_no_nan(estimator):
    """log-ratio 100 (exp overflows float32) on a token whose off-policy weight is 0 (IcePop masks
    ratios above its band): without the +-20 clamp, 0 x inf is a NaN gradient for the whole batch."""
    logprobs = torch.tensor([[0.0, -0.1, -0.2]], requires_grad=True)
    old = torch.tensor([[0.0, -100.1, -0.2]])
    microbatch = {
        "loss_mask": torch.tensor([[0, 1, 1]]),
        "advantages": torch.tensor([[1.0] * 3]),
        "old_logprobs": old,
        "rollout_logprobs": old,
    }
    config = AlgorithmConfig(advantage_estimator=estimator, off_policy="icepop")
    loss, _, _ = run(config, logprobs, microbatch)
    assert math.isfinite(loss) and torch.isfinite(logprobs.grad).all()


def test_dr_grpo_constant_normaliser():
    logprobs, microbatch = clip_case()
    config = AlgorithmConfig(advantage_estimator="dr_grpo", dr_grpo_norm_len=4, off_policy="none")
    loss, tokens, _ = run(config, logprobs, microbatch)
    assert loss == pytest.approx(0.35)  # same token sum as GRPO
    assert tokens == 4 * 4  # dr_grpo_norm_len x sequences, not the 6 real tokens


def test_gspo_sequence_ratio_and_clip():
    logprobs, microbatch = clip_case()
    loss, tokens, report = run(AlgorithmConfig(advantage_estimator="gspo", off_policy="none"), logprobs, microbatch)
    # s = geometric mean of the row's ratios: sqrt(1.65) = 1.2845 -> 1.2 (clipped) => -1.2
    # sqrt(0.425) = 0.6519 -> 0.8 (clipped) => +0.8;  0.5 => -0.5;  1.5 => +1.5
    assert loss == pytest.approx(-1.2 + 0.8 - 0.5 + 1.5)
    assert tokens == 4 and report["clip_fraction"] == 4  # both tokens of rows 0 and 1
    # unclipped rows: d/d logp_t of -A s / 4 sequences with s = exp(mean log r): -A s / (n * 4)
    expected = torch.tensor([[0, 0, 0], [0, 0, 0], [0, -0.5 / 4, 0], [0, 1.5 / 4, 0]])
    torch.testing.assert_close(logprobs.grad, expected)


def test_grpo_end_to_end_from_rewards():
    # groups a = [1, 0], b = [3, 1]: advantages +-1/sqrt(2); ratio 1 everywhere
    adv = group_advantages([1.0, 0.0, 3.0, 1.0], ["a", "a", "b", "b"], AlgorithmConfig()).advantages
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 1, 1]])
    logprobs = torch.full((4, 3), -1.0, requires_grad=True)
    microbatch = {"loss_mask": mask, "advantages": adv[:, None].expand(4, 3), "old_logprobs": torch.full((4, 3), -1.0)}
    loss, tokens, _ = run(AlgorithmConfig(off_policy="none"), logprobs, microbatch)
    # sum_i -A_i n_i = -(3 - 1 + 2 - 2) / sqrt(2)
    assert loss == pytest.approx(-2 / math.sqrt(2), rel=1e-5) and tokens == 8


def test_kl_estimators():
    logp, ref = torch.tensor([math.log(0.5), 0.0]), torch.tensor([math.log(0.25), -30.0])
    # k1 = logp - ref;  k3 = exp(ref - logp) - (ref - logp) - 1
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([math.log(2), 30.0]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), torch.tensor([0.5 + math.log(2) - 1, math.exp(-30) + 29.0]))
    # low_var_kl: log ratio clamped to [-20, 20] (exp(-20) + 19), then the value to [-10, 10]
    torch.testing.assert_close(kl_penalty(logp, ref, "low_var_kl"), torch.tensor([0.5 + math.log(2) - 1, 10.0]))


def test_kl_term_in_loss():
    logprobs = torch.tensor([[0.0, math.log(0.5)]], requires_grad=True)
    microbatch = {
        "loss_mask": torch.tensor([[0, 1]]),
        "advantages": torch.zeros(1, 2),
        "old_logprobs": logprobs.detach().clone(),
        "ref_logprobs": torch.tensor([[0.0, math.log(0.25)]]),
    }
    config = AlgorithmConfig(off_policy="none", kl_coef=0.1, kl_estimator="k1")
    loss, tokens, report = run(config, logprobs, microbatch)
    assert loss == pytest.approx(0.1 * math.log(2)) and report["kl"] == pytest.approx(math.log(2))
    assert report["pg_loss"] == 0.0 and tokens == 1
    with pytest.raises(ValueError, match="ref_logprobs"):
        make_policy_loss(config)(logprobs, {k: v for k, v in microbatch.items() if k != "ref_logprobs"})


def test_masked_tokens_leave_loss_and_normaliser():
    # a hole in loss_mask (what rollout.mask_stale_tokens leaves on a resumed sample's older
    # tokens) drops the token from the loss and the normaliser; a row with none left drops out
    logprobs, microbatch = clip_case()
    microbatch["loss_mask"] = torch.tensor([[0, 1, 0], [0, 1, 1], [0, 1, 0], [0, 0, 0]])
    loss, tokens, report = run(AlgorithmConfig(off_policy="none"), logprobs, microbatch)
    assert loss == pytest.approx(-1.1 + 0.85 + 0.8 - 0.5)  # row 0 col 2 and row 3 dropped
    assert tokens == 4 and report["sequences"] == 3 and policy_metrics(report, tokens)["tokens"] == 4
    assert logprobs.grad[0, 2] == 0 and logprobs.grad[3].abs().sum() == 0
    assert "stale_tokens" not in report


def test_gradient_step_moves_probability_with_advantage_sign():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 8, requires_grad=True)
    targets = torch.randint(0, 8, (2, 4))

    def token_logprobs():
        return torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]

    before = token_logprobs().detach()
    microbatch = {
        "loss_mask": torch.ones(2, 4),
        "advantages": torch.tensor([[1.0] * 4, [-1.0] * 4]),
        "old_logprobs": before.clone(),
        "rollout_logprobs": before.clone(),
    }
    loss_sum, num_tokens, _ = make_policy_loss(AlgorithmConfig())(token_logprobs(), microbatch)
    (loss_sum / num_tokens).backward()
    with torch.no_grad():
        logits -= 0.5 * logits.grad
    after = token_logprobs().detach()
    assert (after[0] > before[0]).all() and (after[1] < before[1]).all()


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "gspo"])
def test_microbatch_split_matches_whole_batch(estimator):
    """The trainer divides the summed loss by the summed num_tokens: splitting rows into
    microbatches must give the whole batch's loss and gradient."""
    torch.manual_seed(1)
    rows, cols = 8, 6
    logprobs = (torch.rand(rows, cols) * -2).requires_grad_(True)
    mask = (torch.rand(rows, cols) > 0.3).int()
    mask[:, 0] = 0
    batch = {
        "loss_mask": mask,
        "advantages": torch.randn(rows, 1).expand(rows, cols),
        "old_logprobs": logprobs.detach() + 0.1 * torch.randn(rows, cols),
        "rollout_logprobs": logprobs.detach() + 0.1 * torch.randn(rows, cols),
    }
    norm = 10 if estimator == "dr_grpo" else None
    loss_fn = make_policy_loss(AlgorithmConfig(advantage_estimator=estimator, dr_grpo_norm_len=norm))
    whole_sum, whole_tokens, _ = loss_fn(logprobs, batch)
    whole = whole_sum / whole_tokens
    (whole_grad,) = torch.autograd.grad(whole, logprobs)
    parts = [loss_fn(logprobs[i : i + 2], {k: v[i : i + 2] for k, v in batch.items()}) for i in range(0, rows, 2)]
    split = sum(p[0] for p in parts) / sum(p[1] for p in parts)
    (split_grad,) = torch.autograd.grad(split, logprobs)
    torch.testing.assert_close(split, whole)
    torch.testing.assert_close(split_grad, whole_grad)
    if estimator == "dr_grpo":
        assert int(whole_tokens) == 10 * rows


def test_metrics_and_input_checks():
    logprobs, microbatch = clip_case()
    _, tokens, report = make_policy_loss(AlgorithmConfig(off_policy="none"))(logprobs, microbatch)
    metrics = policy_metrics({k: float(v) for k, v in report.items()}, float(tokens))
    assert metrics["clip_fraction"] == pytest.approx(2 / 6) and metrics["tokens"] == 6
    assert metrics["loss"] == pytest.approx(0.35 / 6)
    with pytest.raises(ValueError, match="rollout_logprobs"):
        make_policy_loss(AlgorithmConfig(off_policy="tis"))(logprobs, microbatch)
    with pytest.raises(ValueError, match=r"microbatch\['advantages'\] has shape \(4, 2\)"):
        make_policy_loss(AlgorithmConfig(off_policy="none"))(logprobs, {**microbatch, "advantages": torch.zeros(4, 2)})
