"""A short colocated RL run (rl.colocate) with Ray on CPU: the embedded engine releases its weights
and KV cache while the trainer trains (it reports 0 weight bytes then), resumes, is re-synced
(broadcast) and generates the next batch with the new weights; every group is accounted for.
Colocation is refused outside rl.mode 'sync'."""

from __future__ import annotations

import os

import pytest

from tests.rl.test_rl_modes import check_ledger, run, tiny_config

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def test_colocated_sync_run(tmp_path):
    config = tiny_config(tmp_path, "sync", colocate=True)
    summary, rows = run(config)
    check_ledger(summary)
    for row in rows:
        assert row["colocate/engine_weight_bytes_before"] > 0, row
        assert row["colocate/engine_weight_bytes"] == 0, row  # released while the trainer trained
        assert row["time/release_s"] > 0 and row["time/resume_s"] > 0
        assert row["rollout/staleness_max"] == 0 and row["train/skipped"] == 0
    # the engines came back: every step after the first generated with the re-synced weights
    assert all(row["rollout/step_generated_tokens_per_s"] > 0 for row in rows)


@pytest.mark.parametrize("mode", ["fully_async", "one_step_off"])
def test_colocate_needs_sync_mode(tmp_path, mode):
    with pytest.raises(ValueError, match="rl.colocate.*rl.mode: sync"):
        tiny_config(tmp_path, mode, colocate=True)


def test_cuda_ipc_needs_colocate(tmp_path):
    from moe_rl.config import RunConfig, from_dict, to_dict

    data = to_dict(tiny_config(tmp_path, "sync"))
    data["sync"]["transport"] = "cuda_ipc"
    with pytest.raises(ValueError, match="rl.colocate"):
        from_dict(RunConfig, data)
