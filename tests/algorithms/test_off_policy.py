"""Off-policy corrections against hand-computed cases: TIS truncation, IcePop masking, MIS."""

import math

import pytest
import torch

from moe_rl.algorithms import AlgorithmConfig, make_policy_loss


def on_policy_batch(w):
    """A = +1, ratio pi/pi_old = 1, and rollout logprobs chosen so that pi_old / mu = w."""
    w = torch.tensor(w)
    old = torch.full(w.shape, math.log(0.4))
    logprobs = old.clone().requires_grad_(True)
    microbatch = {
        "loss_mask": torch.ones(w.shape, dtype=torch.int),
        "advantages": torch.ones(w.shape),
        "old_logprobs": old,
        "rollout_logprobs": old - torch.log(w),
    }
    return logprobs, microbatch


def run(config, logprobs, microbatch):
    loss_sum, num_tokens, report = make_policy_loss(config)(logprobs, microbatch)
    (loss_sum / num_tokens).backward()
    return loss_sum.item(), int(num_tokens), {k: float(v) for k, v in report.items()}


def test_tis_truncates_the_ratio_at_the_cap():
    logprobs, microbatch = on_policy_batch([[0.5, 1.5, 3.0]])
    loss, tokens, report = run(AlgorithmConfig(off_policy="tis", tis_cap=2.0), logprobs, microbatch)
    # per token -A * r * min(w, 2) = -0.5, -1.5, -2.0
    assert loss == pytest.approx(-4.0) and tokens == 3
    assert report["tis_weight"] == pytest.approx(4.0) and report["tis_truncated"] == 1
    assert report["logprob_diff_abs"] == pytest.approx(math.log(2) + math.log(1.5) + math.log(3))
    # the weight is a constant: d(loss / 3)/d logp = -min(w, 2) / 3
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.5, -1.5, -2.0]]) / 3)


def test_icepop_masks_tokens_outside_the_band():
    logprobs, microbatch = on_policy_batch([[0.4, 1.5, 6.0]])
    config = AlgorithmConfig(off_policy="icepop", icepop_low=0.5, icepop_high=5.0)
    loss, tokens, report = run(config, logprobs, microbatch)
    # weights: 0 (0.4 < 0.5), 1.5 (inside, kept as the IS weight), 0 (6 > 5)
    assert loss == pytest.approx(-1.5)
    assert tokens == 3  # masked tokens stay in the normaliser
    assert report["icepop_masked"] == 2 and report["icepop_weight"] == pytest.approx(1.5)
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, -1.5, 0.0]]) / 3)


def test_mis_drops_whole_sequences_by_geometric_mean():
    # geometric means: sqrt(0.5 * 2) = 1 (kept), sqrt(2 * 4) = 2.83 > 2, sqrt(0.3 * 0.3) = 0.3 < 0.5
    logprobs, microbatch = on_policy_batch([[0.5, 2.0], [2.0, 4.0], [0.3, 0.3]])
    loss, tokens, report = run(AlgorithmConfig(off_policy="mis", mis_low=0.5, mis_high=2.0), logprobs, microbatch)
    assert loss == pytest.approx(-2.0)  # only row 0, weight 1 per token (no re-weighting)
    assert tokens == 6
    assert report["mis_masked_sequences"] == 2 and report["mis_masked_tokens"] == 4
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-1.0, -1.0], [0.0, 0.0], [0.0, 0.0]]) / 6)


def test_mis_geometric_mean_ignores_masked_columns():
    logprobs, microbatch = on_policy_batch([[50.0, 1.0, 1.0]])
    microbatch["loss_mask"] = torch.tensor([[0, 1, 1]])  # the prompt column's huge gap is not counted
    loss, _, report = run(AlgorithmConfig(off_policy="mis"), logprobs, microbatch)
    assert loss == pytest.approx(-2.0) and report["mis_masked_sequences"] == 0


def test_none_reports_the_gap_without_weighting():
    logprobs, microbatch = on_policy_batch([[0.5, 3.0]])
    loss, _, report = run(AlgorithmConfig(off_policy="none"), logprobs, microbatch)
    assert loss == pytest.approx(-2.0)
    assert report["logprob_diff_abs"] == pytest.approx(math.log(2) + math.log(3))


def test_padding_with_infinite_logprobs_stays_finite():
    _, microbatch = on_policy_batch([[1.0, 1.0]])
    logprobs = torch.tensor([[float("-inf"), math.log(0.4)]], requires_grad=True)
    microbatch["loss_mask"] = torch.tensor([[0, 1]])
    microbatch["rollout_logprobs"] = torch.tensor([[float("-inf"), math.log(0.4)]])
    for off_policy in ("tis", "icepop", "mis"):
        for estimator in ("grpo", "gspo"):
            logprobs.grad = None
            config = AlgorithmConfig(off_policy=off_policy, advantage_estimator=estimator, kl_coef=0.1)
            microbatch["ref_logprobs"] = torch.tensor([[0.0, math.log(0.4)]])
            loss, _, _ = run(config, logprobs, microbatch)
            assert loss == pytest.approx(-1.0) and torch.isfinite(logprobs.grad).all()
