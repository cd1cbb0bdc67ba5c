"""A short RL run through the Ray job with a KL term: the trainer ranks build the frozen reference,
every step logs loss/kl (0 at step 1, where policy == reference; > 0 once the policy moved) and
the reference's forward time."""

from __future__ import annotations

import os

import pytest

from tests.rl.test_rl_modes import STEPS, check_ledger, run, tiny_config

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def response_length(response, answer, sample) -> float:
    """A reward that varies within every group of the random model's long-tailed responses, so
    every step has a gradient (the task's own reward is 0 for a random model)."""
    return float(len(sample.response_ids))


def test_sync_run_with_kl_logs_loss_kl(tmp_path):
    config = tiny_config(tmp_path, "sync")
    config.rollout = config.rollout.replace(reward="tests.rl.test_rl_kl:response_length")
    config.algorithm.kl_coef, config.algorithm.kl_estimator = 0.1, "low_var_kl"
    summary, rows = run(config)
    check_ledger(summary)
    kls = [row["loss/kl"] for row in rows]
    assert rows[0]["train/grad_norm"] > 0
    assert len(kls) == STEPS and kls[0] == 0.0 and all(kl > 0 for kl in kls[1:]), kls
    assert all(row["time/ref_logprobs_s"] > 0 for row in rows)
