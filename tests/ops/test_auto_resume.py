"""`moe-rl train --auto-resume`, what scripts/slurm/train.sbatch runs on every start of a job: its
refusals name the flag and the fix before anything starts; with a run checkpoint in output_dir
the run continues as `--resume output_dir` would, without one it starts afresh; a run stopped by
a signal exits 75 naming its checkpoint. `moe_rl.jobs.rl.run` is a stand-in here: no Ray, no
process (the real path runs under SLURM in test_slurm.py)."""

from __future__ import annotations

import json
import signal

import pytest

from moe_rl import cli

DEMO = "configs/demo_cpu.yaml"  # an RL config
SUPERVISED = "configs/smoke_cpu.yaml"


@pytest.fixture(autouse=True)
def ray_auth_untouched(monkeypatch):
    """protect_local_ray would turn token auth on for every later Ray of this process."""
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")


@pytest.fixture
def rl_runs(monkeypatch):
    """The `resume` argument of each `rl.run` call; the stand-in returns `summary` (a finished run
    unless a test sets "preempted")."""
    from moe_rl.jobs import rl

    calls = {"resume": [], "summary": {"reward_first": 0.0, "reward_last": 0.0, "wall_s": 1.0, "setup_s": 0.5}}

    def run(config, resume=False, stop=None):
        calls["resume"].append(resume)
        return calls["summary"]

    monkeypatch.setattr(rl, "run", run)
    return calls


def error_of(capsys, argv: list[str]) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("moe-rl: error: ") and err.count("\n") == 1, err
    return err


def used_run_dir(path, checkpoint_step: int | None = None):
    """A run directory as an earlier run left it, with a run checkpoint at `checkpoint_step`."""
    from moe_rl.rl.resume import checkpoint_dir

    path.mkdir()
    (path / "config.json").write_text("{}")
    (path / "metrics.jsonl").write_text('{"step": 1}\n')
    if checkpoint_step is not None:
        checkpoint = checkpoint_dir(path, checkpoint_step)
        checkpoint.mkdir(parents=True)
        state = {"step": checkpoint_step, "weight_version": checkpoint_step, "metrics_offset": checkpoint_step}
        (checkpoint / "state.json").write_text(json.dumps(state))
        (checkpoint / "rollout.json").write_text("{}")
    return path


@pytest.mark.parametrize(
    "argv, message",
    [
        ([DEMO, "--auto-resume", "--resume", "runs/x"], "--auto-resume and --resume: give one"),
        (["--auto-resume", "steps=3"], "--auto-resume: give the run's CONFIG"),
        ([DEMO, "--auto-resume", "--overwrite"], "--auto-resume and --overwrite: give one"),
        ([SUPERVISED, "--auto-resume"], "--auto-resume: only RL runs write run checkpoints"),
    ],
)
def test_auto_resume_refusals_name_the_flag_and_the_fix(argv, message, rl_runs, capsys):
    assert message in error_of(capsys, ["train", *argv])
    assert rl_runs["resume"] == []


def test_auto_resume_refuses_a_used_run_dir_without_a_checkpoint(tmp_path, rl_runs, capsys):
    run = used_run_dir(tmp_path / "run")
    err = error_of(capsys, ["train", DEMO, f"output_dir={run}", "--auto-resume"])
    assert "--auto-resume: output_dir" in err and "holds a run without a run checkpoint" in err
    assert "--overwrite instead of --auto-resume" in err
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n' and rl_runs["resume"] == []


def test_auto_resume_continues_a_checkpointed_run_and_starts_a_fresh_one(tmp_path, rl_runs):
    assert cli.main(["train", DEMO, f"output_dir={tmp_path / 'new'}", "--auto-resume"]) == 0
    run = used_run_dir(tmp_path / "run", checkpoint_step=3)
    assert cli.main(["train", DEMO, f"output_dir={run}", "steps=7", "--auto-resume"]) == 0
    assert rl_runs["resume"] == [False, True]


def test_a_preempted_run_exits_75_naming_its_checkpoint(tmp_path, rl_runs, capsys):
    run = used_run_dir(tmp_path / "run", checkpoint_step=3)
    rl_runs["summary"] = {"preempted": "SIGUSR1"}
    assert cli.main(["train", DEMO, f"output_dir={run}", "steps=9", "--auto-resume"]) == 75
    out = capsys.readouterr().out
    assert f"preempted by SIGUSR1: run checkpoint at step 3/9 ({run}/checkpoints/step_000003)" in out
    assert f"continue with: moe-rl train --resume {run}" in out


def test_a_stop_signal_before_the_run_started_exits_75(tmp_path, monkeypatch, capsys, rl_runs):
    """SIGTERM while the config's inputs are checked (a real signal to this process, raised by the
    check): nothing started, nothing to save; exit 75, so that the job is requeued."""
    from moe_rl.jobs import preflight

    monkeypatch.setattr(preflight, "check_run", lambda config: signal.raise_signal(signal.SIGTERM))
    assert cli.main(["train", DEMO, f"output_dir={tmp_path / 'run'}"]) == 75
    assert "preempted by SIGTERM before the run started; start it again" in capsys.readouterr().out
    assert rl_runs["resume"] == [] and not (tmp_path / "run").exists()


def test_a_stop_signal_while_a_supervised_config_is_read_reaches_the_handler_before(monkeypatch):
    """`moe-rl train` catches stop signals before it knows the run's kind; a supervised run gives
    them back to the handlers from before (here a recording one) and raises the one it caught."""
    from moe_rl import config as config_module
    from moe_rl.jobs import preflight

    caught, load_config = [], config_module.load_config

    def load_with_signal(*args):
        signal.raise_signal(signal.SIGTERM)
        return load_config(*args)

    def stop_here(config):
        raise ValueError(f"caught {caught}")

    monkeypatch.setattr(config_module, "load_config", load_with_signal)
    monkeypatch.setattr(preflight, "check_run", stop_here)
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: caught.append(signum))
    try:
        assert cli.main(["train", SUPERVISED]) == 2
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert caught == [signal.SIGTERM]
