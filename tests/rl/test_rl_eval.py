"""A fully-async RL run judged as a user judges one, through `moe-rl train` in this process:
evaluation every 25 steps on a held-out split of copy_digits (digit pairs training never draws),
rollout dumps on. Proves: the held-out curve rises (pass@k logged at every evaluation), every
eval sample is at one weight version, the dumps read back with `moe-rl samples`, the report plots
the eval curve."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from moe_rl import cli
from moe_rl.rollout.dump import SampleDump
from moe_rl.tasks.digits import held_out
from tests.tiny_models import QWEN3_MOE, hf_fields

pytestmark = pytest.mark.world  # starts Ray, trainer ranks and an engine (tests/conftest.py)

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
STEPS, EVERY = 200, 25


# 70-85 s quiet; under a busy loop per core each of its 200 steps slows several times, past
# pytest's 600 s: its own limit, a hang guard (docs/testing.md)
@pytest.mark.timeout(1800)
def test_held_out_eval_rises_and_dumps_read_back(tmp_path, capsys):
    run_dir = tmp_path / "run"
    config = {
        "model": {"hf_config": hf_fields(QWEN3_MOE, num_hidden_layers=2, max_position_embeddings=64)},
        "trainer": {"world_size": 2, "ep": 2, "micro_batch_size": 64, "global_batch_size": 128,
                    "routing_replay": True, "optimizer": {"lr": 0.003}},
        "rollout": {"task": "copy_digits", "task_options": {"length": 2, "split": "train"}, "groups_per_step": 16,
                    "n_samples_per_prompt": 8, "max_new_tokens": 2, "max_staleness": 1, "dump": True},
        "eval": {"every": EVERY, "at_start": True, "datasets": [
            {"name": "heldout", "task": "copy_digits", "task_options": {"length": 2, "split": "eval"},
             "num_prompts": 27, "n_samples_per_prompt": 4}]},
        "algorithm": {"advantage_estimator": "grpo", "off_policy": "tis"},
        "sync": {"pause_mode": "abort", "bucket_bytes": 1 << 24},
        "rl": {"mode": "fully_async", "save_hf": False},
        "steps": STEPS,
        "save_checkpoint": False,
        "output_dir": str(run_dir),
    }  # fmt: skip
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    assert cli.main(["train", str(path)]) == 0

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = sorted((r for r in rows if "eval/heldout/reward_mean" in r), key=lambda r: r["step"])
    # every due version evaluated once (a row moves to the next version only when the swap cut every sample)
    due = [0, *range(EVERY, STEPS + 1, EVERY)]
    assert len(evals) == len(due)
    for row, step in zip(evals, due):
        assert row["step"] - step in (0, 1)
        assert row["eval/heldout/weight_version_min"] == row["step"]
        for key in ("pass@1", "pass@2", "pass@4", "mean@4", "truncation_rate", "seconds", "reward_errors"):
            assert f"eval/heldout/{key}" in row
    # the held-out reward (partial credit per digit; ~0.1 for a random policy) rises: the last three
    # evaluations (324 samples) against the first (108); measured: +0.12 to +0.26 over 3 runs
    curve = [r["eval/heldout/reward_mean"] for r in evals]
    assert sum(curve[-3:]) / 3 >= curve[0] + 0.08, [round(c, 3) for c in curve]
    assert all("eval/in_flight" in r for r in rows if "time/step_s" in r)

    eval_dump = SampleDump(run_dir / "eval" / "heldout")
    assert eval_dump.steps() == [r["step"] for r in evals]
    for step in eval_dump.steps():
        records = eval_dump.read(step)
        assert len(records) == 27 * 4
        for record in records:
            assert len({v for _, _, v in record["versions"]}) == 1  # one weight version per eval sample
        assert all(held_out([t - 10 for t in r["prompt_ids"][1:-1]]) for r in records)
    trained = SampleDump(run_dir / "rollouts")
    assert trained.steps() == list(range(1, STEPS + 1))
    assert not any(held_out([t - 10 for t in r["prompt_ids"][1:-1]]) for r in trained.read(STEPS))

    capsys.readouterr()
    assert cli.main(["samples", str(run_dir), "--eval", "heldout", "--step", str(evals[-1]["step"]), "--worst"]) == 0
    assert cli.main(["samples", str(run_dir), "--step", str(STEPS), "--limit", "2"]) == 0
    assert "reward" in capsys.readouterr().out
    assert (run_dir / "plots" / "eval.png").is_file()


def test_hold_sync_evaluates_every_sample_at_the_version_it_started(tmp_path):
    """eval.hold_sync in a fully-async run with long responses: the weight sync waits for the running
    evaluation, so no eval sample is restarted and each evaluation is wholly at its step's version."""
    from moe_rl.config import RunConfig, from_dict
    from moe_rl.jobs import rl
    from tests.tiny_models import QWEN3_MOE_SMALL

    steps = 4
    config = from_dict(
        RunConfig,
        {
            "model": {"hf_config": hf_fields(QWEN3_MOE_SMALL, max_position_embeddings=64)},
            "trainer": {"world_size": 2, "ep": 2, "micro_batch_size": 4, "global_batch_size": 8},
            "rollout": {"task": "copy_digits_long_tail", "task_options": {"num_stop_tokens": 40},
                        "groups_per_step": 4, "n_samples_per_prompt": 2, "max_new_tokens": 24, "max_staleness": 2},
            "eval": {"every": 1, "hold_sync": True, "datasets": [
                {"name": "tail", "task": "copy_digits_long_tail", "task_options": {"num_stop_tokens": 40},
                 "num_prompts": 8, "n_samples_per_prompt": 2, "seed": 7}]},
            "sync": {"pause_mode": "abort", "bucket_bytes": 1 << 20},
            "rl": {"mode": "fully_async", "report": False, "save_hf": False},
            "steps": steps,
            "output_dir": str(tmp_path / "run"),
        },
    )  # fmt: skip
    rl.run(config)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = sorted((r for r in rows if "eval/tail/restarts" in r), key=lambda r: r["step"])
    assert [r["step"] for r in evals] == list(range(1, steps + 1))
    for row in evals:
        assert row["eval/tail/restarts"] == 0
        assert row["eval/tail/weight_version_min"] == row["eval/tail/weight_version_max"] == row["step"]
