"""`moe-rl train CONFIG [a.b=value ...]`: validate the config, then run its job.

A config with a `rollout:` section runs the RL job (`moe_rl.jobs.rl`: Ray actors for the trainer
world, the engines and the rollout manager); otherwise the supervised job runs on a trainer
world, spawned as gloo ranks on one machine or joined under torchrun. The config is fully
validated (layout vs model included) and its inputs checked (`moe_rl.jobs.preflight`: weights,
tokenizer, datasets, task options, rewards, agents, eval datasets) before any process starts.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
from pathlib import Path

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
        "--overwrite",
        action="store_true",
        help="start afresh in an output_dir that holds an earlier run (its files are deleted)",
    )


def run(args) -> int:

    # heavy: torch (through moe_rl.config); the CLI imports every command module to build its parser
    from moe_rl.config import load_config
    from moe_rl.jobs.preflight import check_run
    from parallel.world import is_first_process

    overrides = list(args.overrides)
    if args.config is not None and "=" in args.config:  # `train --resume DIR steps=20`
        overrides.insert(0, args.config)
        args.config = None
    if args.config is None and args.resume is None:
        raise ValueError("train: give a CONFIG, or --resume RUN_DIR")
    if args.resume is not None:
        overrides.append(f"output_dir={args.resume}")
    if args.config is None:  # the run's own config, as written at its start (JSON: exact floats)
        config = _load_run_config(Path(args.resume) / "config.json", overrides)
    else:
        config = load_config(args.config, overrides)
    if args.resume is not None and not config.is_rl:
        raise ValueError("--resume: only RL runs write run checkpoints; restart supervised runs from their config")
    check_run(config)  # every input the processes would open, before any starts (or a run dir is cleared)
    if args.resume is None and is_first_process():  # under torchrun rank 0 decides
        fresh_run_dir(Path(config.output_dir), args.overwrite)
    if config.is_rl:
        protect_local_ray()
        # heavy: Ray, and torch; imported after protect_local_ray set Ray's auth
        from moe_rl.jobs import rl

        summary = rl.run(config, resume=args.resume is not None)
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


def fresh_run_dir(run_dir, overwrite: bool) -> None:
    """A fresh run must not mix with an earlier one (its metrics would be appended to, its
    checkpoints picked up by a later --resume): refuse a used output_dir unless `overwrite`, and
    never delete a directory that is not a run's."""
    if not run_dir.exists() or (run_dir.is_dir() and not any(run_dir.iterdir())):
        return
    if not run_dir.is_dir() or not any((run_dir / name).is_file() for name in RUN_FILES):
        raise ValueError(
            f"output_dir: {str(run_dir)!r} exists and is not a moe-rl run directory; choose another output_dir"
        )
    if not overwrite:
        raise ValueError(
            f"output_dir: {str(run_dir)!r} holds an earlier run; continue it with --resume "
            f"{run_dir}, start afresh with --overwrite (deletes it), or choose another output_dir"
        )
    shutil.rmtree(run_dir)


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
