"""Speculative rollout end to end on CPU: `moe-rl train` of the speculative bench config (a tiny
DeepSeek-V3 with an MTP layer trained online, R3, the embedded engine drafting k = 2 tokens) for a
few sync steps. Every step logs `rollout/spec_accept_rate` and `rollout/spec_tokens_per_forward`,
and the trainer, replaying the routing rows the speculating engine returned, computes the engine's
own logprob for every trained token: the rows are those that generated each token.
"""

from __future__ import annotations

import json
import os

import pytest

from moe_rl.config import load_config
from tests.rl.test_rl_modes import PROBE_BOUND

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
STEPS = 3


def test_speculative_rollout_trains_with_r3_and_logs_its_rates(tmp_path):
    from moe_rl.jobs import rl

    config = load_config(
        "configs/bench/spec_mtp_copy.yaml",
        [
            f"steps={STEPS}",
            f"output_dir={tmp_path}",
            "rollout.groups_per_step=4",
            "trainer.global_batch_size=16",
            "trainer.micro_batch_size=8",
            "rl.report=false",
            "rl.save_hf=false",
        ],
    )
    rl.run(config)
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row in rows:
        assert 0.0 <= row["rollout/spec_accept_rate"] <= 1.0, row["step"]
        assert 1.0 <= row["rollout/spec_tokens_per_forward"] <= 3.0, row["step"]  # k = 2: at most 3
        assert row["offpolicy/logprob_diff_max"] < PROBE_BOUND, row["step"]  # R3 replays the verify's rows
        assert row["train/mtp_loss"] > 0  # the draft trains with the policy
    assert rows[-1]["rollout/spec_num_proposed_drafts"] == 2 * rows[-1]["rollout/spec_verify_ct"] > 0
