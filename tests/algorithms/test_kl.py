"""KL to the reference against hand-computed values: each estimator on a small tensor, the KL
term and its gradient in the loss, the `kl` report, and the reference-related config checks."""

import math

import pytest
import torch

from moe_rl.algorithms import AlgorithmConfig, make_policy_loss, policy_metrics
from moe_rl.algorithms.policy_loss import kl_penalty

# three tokens: pi = 0.5 vs ref 0.25, pi = 0.25 vs ref 0.5, pi = ref = 0.1
LOGP = torch.log(torch.tensor([0.5, 0.25, 0.1]))
REF = torch.log(torch.tensor([0.25, 0.5, 0.1]))
L2 = math.log(2)


@pytest.mark.parametrize(
    "estimator, expected",
    [
        ("k1", [L2, -L2, 0.0]),  # logp - ref
        ("k2", [L2**2 / 2, L2**2 / 2, 0.0]),  # (logp - ref)^2 / 2
        ("mse", [L2**2 / 2, L2**2 / 2, 0.0]),
        ("k3", [0.5 + L2 - 1, 2 - L2 - 1, 0.0]),  # r - log r - 1, r = ref / pi
        ("low_var_kl", [0.5 + L2 - 1, 2 - L2 - 1, 0.0]),  # k3, clamps not reached
    ],
)
def test_estimators_by_hand(estimator, expected):
    torch.testing.assert_close(kl_penalty(LOGP, REF, estimator), torch.tensor(expected))


def test_estimators_are_zero_at_the_reference():
    for estimator in ("k1", "k2", "mse", "k3", "low_var_kl"):
        assert torch.equal(kl_penalty(LOGP, LOGP.clone(), estimator), torch.zeros(3)), estimator


def test_low_var_kl_clamps():
    far = kl_penalty(torch.tensor([0.0, -40.0]), torch.tensor([-40.0, 0.0]), "low_var_kl")
    # log ratio -40 -> clamped to -20: e^-20 + 19 -> clamped to 10; +40 -> 20: e^20 - 21 -> 10
    assert far.tolist() == [10.0, 10.0]
    assert float(kl_penalty(torch.tensor([0.0]), torch.tensor([-40.0]), "k3")) == pytest.approx(39.0)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_term_loss_gradient_and_metric(estimator):
    """Zero advantages: the loss is kl_coef x the token mean of the estimator; its gradient is the
    estimator's derivative (k1: 1, k2: logp - ref, k3: 1 - ref/pi) over the token count."""
    logprobs = torch.cat([torch.zeros(1), LOGP]).reshape(1, 4).requires_grad_(True)
    ref = torch.cat([torch.zeros(1), REF]).reshape(1, 4)
    microbatch = {
        "loss_mask": torch.tensor([[0, 1, 1, 1]]),
        "advantages": torch.zeros(1, 4),
        "old_logprobs": logprobs.detach().clone(),
        "ref_logprobs": ref,
    }
    config = AlgorithmConfig(off_policy="none", kl_coef=0.05, kl_estimator=estimator)
    loss, tokens, report = make_policy_loss(config)(logprobs, microbatch)
    per_token = kl_penalty(LOGP, REF, estimator)
    assert int(tokens) == 3
    assert float(loss.detach()) == pytest.approx(0.05 * float(per_token.sum()), rel=1e-6)
    assert float(report["kl"]) == pytest.approx(float(per_token.sum()), rel=1e-6)
    assert policy_metrics({k: float(v) for k, v in report.items()}, 3)["kl"] == pytest.approx(
        float(per_token.mean()), rel=1e-6
    )
    loss.backward()
    derivative = {"k1": torch.ones(3), "k2": LOGP - REF, "k3": 1 - (REF - LOGP).exp()}[estimator]
    torch.testing.assert_close(logprobs.grad[0, 1:], 0.05 * derivative)
    assert logprobs.grad[0, 0] == 0


def test_reference_config_checks(tmp_path):
    assert AlgorithmConfig(kl_coef=0.1, kl_estimator="mse").needs_reference
    with pytest.raises(ValueError, match="algorithm.ref_model_path"):
        AlgorithmConfig(ref_model_path=str(tmp_path))  # kl_coef 0
    with pytest.raises(ValueError, match="no config.json"):
        AlgorithmConfig(kl_coef=0.1, ref_model_path=str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert AlgorithmConfig(kl_coef=0.1, ref_model_path=str(tmp_path)).ref_model_path == str(tmp_path)
