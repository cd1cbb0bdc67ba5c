"""`moe-rl plan CONFIG [a.b=value ...]`: validate a GPU run config and print its placement, parallel
groups, per-GPU memory estimate and bytes per weight sync (`moe_rl.plan.planner`). Starts nothing; exit
code 2 with the reason (`moe-rl: error: ...`) when the config cannot run."""

from __future__ import annotations

COMMAND = ("plan",)
HELP = "check a cluster config: placement, parallel groups, memory per GPU, sync bytes and seconds"


def add_arguments(parser) -> None:
    parser.add_argument("config", help="YAML run config with a cluster section (see configs/models/)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.ep=16 cluster.nodes=4")


def run(args) -> int:
    # heavy: torch (through moe_rl.config); the CLI imports every command module to build its parser
    from moe_rl.config import load_config
    from moe_rl.plan.planner import make_plan

    print(make_plan(load_config(args.config, args.overrides)).render())
    return 0
