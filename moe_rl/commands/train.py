"""`moe-rl train CONFIG [a.b=value ...]`: validate the config, then run the job on a trainer world.

On one machine the trainer world is spawned as gloo ranks; under torchrun this process is
one rank of it. The config is fully validated (layout vs model included) before any rank starts.
"""

from __future__ import annotations

COMMAND = ("train",)
HELP = "train a model from a YAML config (dotted overrides: trainer.tp=2)"


def add_arguments(parser) -> None:
    parser.add_argument("config", help="YAML run config (see configs/)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.tp=2 steps=20")


def run(args) -> int:
    from moe_rl.config import load_config
    from moe_rl.jobs import supervised
    from parallel.world import init_distributed, launched_by_torchrun, spawn

    config = load_config(args.config, args.overrides)
    if launched_by_torchrun():
        init_distributed()
        losses = supervised.run(config)
    else:
        losses = spawn(supervised.run, config.trainer.world_size, config, timeout_s=None)[0]
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps; run dir: {config.output_dir}")
    return 0
