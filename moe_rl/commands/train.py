"""`moe-rl train CONFIG [a.b=value ...]`: validate the config, then run its job.

A config with a `rollout:` section runs the RL job (`moe_rl.jobs.rl`: Ray actors for the trainer
world, the engines and the rollout manager); otherwise the supervised job runs on a trainer
world, spawned as gloo ranks on one machine or joined under torchrun. The config is fully
validated (layout vs model included) and its inputs checked (`moe_rl.jobs.preflight`: weights,
tokenizer, datasets, task options, rewards, agents, eval datasets) before any process starts.

An RL run stopped by SIGTERM or SIGUSR1 writes a run checkpoint at its next safe point and exits
`EXIT_PREEMPTED` (75) naming the `--resume` command; `--auto-resume` continues the config's
output_dir when it holds a run checkpoint, so a requeued SLURM job (`scripts/slurm/train.sbatch`)
runs the same command as its first start.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import sys
from pathlib import Path

from moe_rl.rl.preemption import EXIT_PREEMPTED, StopSignals

COMMAND = ("train",)
HELP = "train a model from a YAML config (dotted overrides: trainer.tp=2); RL when it has a rollout section"


def add_arguments(parser) -> None:
    parser.add_argument("config", nargs="?", help="YAML run config (see configs/); with --resume: optional")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.tp=2 steps=20")
    parser.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue an RL run from its newest run checkpoint (config: RUN_DIR/config.json)",
    )
    parser.add_argument(
        "--auto-resume",
        action="store_true",
        help="continue the run in the config's output_dir from its newest run checkpoint if it has one, "
        "else start afresh (the same command for a job's first start and its requeued ones)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="start afresh in an output_dir that holds an earlier run (its files are deleted)",
    )


def run(args) -> int:
    # SIGTERM / SIGUSR1 are caught from the first moment: a stop before the RL run's processes start
    # still exits EXIT_PREEMPTED (the sbatch script requeues on it); a supervised run gets them back
    with StopSignals(grace_s=None) as stop:
        return _run(args, stop)


def _run(args, stop: StopSignals) -> int:

    # heavy: torch (through moe_rl.config); the CLI imports every command module to build its parser
    from moe_rl.config import load_config
    from moe_rl.jobs.preflight import check_run
    from parallel.world import is_first_process

    overrides = list(args.overrides)
    if args.config is not None and "=" in args.config:  # `train --resume DIR steps=20`
        overrides.insert(0, args.config)
        args.config = None
    if args.auto_resume:
        _check_auto_resume(args)
    if args.config is None and args.resume is None:
        raise ValueError("train: give a CONFIG, or --resume RUN_DIR")
    if args.resume is not None:
        overrides.append(f"output_dir={args.resume}")
    if args.config is None:  # the run's own config, as written at its start (JSON: exact floats)
        config = _load_run_config(Path(args.resume) / "config.json", overrides)
    else:
        config = load_config(args.config, overrides)
    flag = "--resume" if args.resume is not None else "--auto-resume" if args.auto_resume else None
    if flag is not None and not config.is_rl:
        raise ValueError(f"{flag}: only RL runs write run checkpoints; restart supervised runs from their config")
    if not config.is_rl:  # the default actions: a stop signal ends a supervised run at once
        stop.release()
        if stop.requested is not None:  # caught while the config was read: acted on now
            signal.raise_signal(signal.Signals[stop.requested])
    check_run(config)  # every input the processes would open, before any starts (or a run dir is cleared)
    if stop.requested is not None:  # before anything started: nothing to save
        return preempted(stop.requested, config)
    resume = args.resume is not None
    if config.is_rl:
        protect_local_ray()
        # heavy: Ray (moe_rl.rl.resume, moe_rl.jobs.rl); imported after protect_local_ray set Ray's auth
        from moe_rl.rl.resume import complete_checkpoints

        resume = resume or (args.auto_resume and bool(complete_checkpoints(config.output_dir)))
    if not resume and is_first_process():  # under torchrun rank 0 decides
        fresh_run_dir(Path(config.output_dir), args.overwrite, auto_resume=args.auto_resume)
    if config.is_rl:
        # heavy: Ray and torch, imported after protect_local_ray as above
        from moe_rl.jobs import rl

        summary = rl.run(config, resume=resume, stop=stop)
        if summary.get("preempted"):
            return preempted(summary["preempted"], config)
        print(
            f"reward {summary['reward_first']:.3f} -> {summary['reward_last']:.3f} over {config.steps} steps "
            f"({config.rl.mode}); {summary['wall_s']:.0f} s wall ({summary['setup_s']:.0f} s start-up); "
            f"run dir: {config.output_dir}"
        )
        return 0
    # heavy: torch (megatron-core once a trainer is built); the CLI imports every command module to build its parser
    from moe_rl.jobs import supervised
    from parallel.world import init_distributed, launched_by_torchrun, spawn

    if launched_by_torchrun():
        init_distributed()
        losses = supervised.run(config)
    else:
        losses = spawn(supervised.run, config.trainer.world_size, config, timeout_s=None)[0]
    if is_first_process():  # every torchrun rank returns the same curve
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps; run dir: {config.output_dir}")
    return 0


def protect_local_ray() -> None:
    """A Ray this command starts keeps token authentication on (its processes listen on every
    interface): a random per-run token in the environment only, inherited by every Ray process.
    Ray reads the mode when it is imported, so this runs before; an explicit RAY_AUTH_MODE, a
    cluster to join (RAY_ADDRESS) or an already imported Ray leave things as they are."""
    if "RAY_AUTH_MODE" in os.environ or os.environ.get("RAY_ADDRESS") or "ray" in sys.modules:
        return
    os.environ["RAY_AUTH_MODE"], os.environ["RAY_AUTH_TOKEN"] = "token", secrets.token_hex(32)


RUN_FILES = ("config.json", "metrics.jsonl")
"""What every moe-rl run writes first: a directory holding one is an earlier run's."""


def fresh_run_dir(run_dir, overwrite: bool, auto_resume: bool = False) -> None:
    """A fresh run must not mix with an earlier one (its metrics would be appended to, its
    checkpoints picked up by a later --resume): refuse a used output_dir unless `overwrite`, and
    never delete a directory that is not a run's. `auto_resume`: the run found there has no run
    checkpoint to continue from (say so rather than suggest --resume)."""
    if not run_dir.exists() or (run_dir.is_dir() and not any(run_dir.iterdir())):
        return
    if not run_dir.is_dir() or not any((run_dir / name).is_file() for name in RUN_FILES):
        raise ValueError(
            f"output_dir: {str(run_dir)!r} exists and is not a moe-rl run directory; choose another output_dir"
        )
    if auto_resume:
        raise ValueError(
            f"--auto-resume: output_dir {str(run_dir)!r} holds a run without a run checkpoint, so there is "
            "nothing to continue (checkpoints need rl.checkpoint_every > 0, or a SIGTERM/SIGUSR1 stop); "
            "start afresh with --overwrite instead of --auto-resume (deletes it), or choose another output_dir"
        )
    if not overwrite:
        raise ValueError(
            f"output_dir: {str(run_dir)!r} holds an earlier run; continue it with --resume "
            f"{run_dir}, start afresh with --overwrite (deletes it), or choose another output_dir"
        )
    shutil.rmtree(run_dir)


def _check_auto_resume(args) -> None:
    if args.resume is not None:
        raise ValueError(
            "--auto-resume and --resume: give one (--resume RUN_DIR continues RUN_DIR; --auto-resume "
            "continues the config's output_dir when it holds a run checkpoint)"
        )
    if args.config is None:
        raise ValueError("--auto-resume: give the run's CONFIG (its output_dir is the run continued)")
    if args.overwrite:
        raise ValueError(
            "--auto-resume and --overwrite: give one (--overwrite deletes the run that --auto-resume continues)"
        )


def preempted(signal_name: str, config) -> int:
    """The run stopped on `signal_name` at a safe point, after writing a run checkpoint there: one
    line saying how to continue it, and the exit status train.sbatch requeues the job on."""

    # heavy: Ray (moe_rl.rl.resume, moe_rl.jobs.rl); imported by the run that just returned
    from moe_rl.rl.resume import complete_checkpoints, latest_checkpoint, load_run_checkpoint

    if not complete_checkpoints(config.output_dir):  # stopped before its processes started
        print(f"preempted by {signal_name} before the run started; start it again with the same command")
        return EXIT_PREEMPTED
    checkpoint = latest_checkpoint(config.output_dir)
    step = load_run_checkpoint(checkpoint).step
    print(
        f"preempted by {signal_name}: run checkpoint at step {step}/{config.steps} ({checkpoint}); "
        f"continue with: moe-rl train --resume {config.output_dir}"
    )
    return EXIT_PREEMPTED


def _load_run_config(path, overrides: list[str]):

    # heavy: torch (through moe_rl.config); the CLI imports every command module to build its parser
    from moe_rl.config import RunConfig, apply_override, from_dict

    if not path.is_file():
        raise ValueError(f"--resume: {str(path)!r} not found; is {str(path.parent)!r} a moe-rl run directory?")
    data = json.loads(path.read_text())
    if "architectures" in data or "model_type" in data:
        raise ValueError(
            f"--resume: {str(path.parent)!r} is an HF model directory, not a moe-rl run directory "
            "(pass the output_dir of an RL run)"
        )
    for override in overrides:
        apply_override(data, override)
    return from_dict(RunConfig, data)
