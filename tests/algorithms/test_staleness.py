"""Per-token stale mask from weight versions, fed to the loss."""

import math

import pytest
import torch

from moe_rl.algorithms import AlgorithmConfig, make_policy_loss
from moe_rl.algorithms import stale_token_mask
from moe_rl.sample import Sample


def test_mask_from_a_resumed_sample():
    # a rollout cut by two weight updates: tokens from versions 3, 3, 4, 5
    sample = Sample(prompt_ids=[1], response_ids=[7, 8, 9, 10], rollout_logprobs=[-1.0] * 4,
                    loss_mask=[1] * 4, weight_versions=["3", "3", "4", "5"])
    assert stale_token_mask(sample.weight_versions, 5, 1).tolist() == [True, True, False, False]
    assert stale_token_mask(sample.weight_versions, 5, 2).tolist() == [False] * 4
    assert stale_token_mask(sample.weight_versions, 6, 0).tolist() == [True] * 4


def test_stale_tokens_leave_the_loss():
    stale = stale_token_mask(["3", "3", "4", "5"], 5, 1)
    old = torch.full((1, 5), math.log(0.5))
    microbatch = {"loss_mask": torch.tensor([[0, 1, 1, 1, 1]]), "advantages": torch.ones(1, 5),
                  "old_logprobs": old, "rollout_logprobs": old,
                  "stale_mask": torch.cat([torch.zeros(1), stale.float()])[None]}
    loss_sum, tokens, report = make_policy_loss(AlgorithmConfig(mask_stale_tokens=True))(old.clone(), microbatch)
    assert float(loss_sum) == pytest.approx(-2.0) and int(tokens) == 2 and int(report["stale_tokens"]) == 2


def test_bad_versions():
    with pytest.raises(ValueError, match="integer version"):
        stale_token_mask(["v3"], 5, 1)
    with pytest.raises(ValueError, match="trainer_version=5"):
        stale_token_mask(["6"], 5, 1)
    with pytest.raises(ValueError, match="max_token_staleness"):
        stale_token_mask(["1"], 5, -1)
