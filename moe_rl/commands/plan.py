"""`moe-rl plan CONFIG [a.b=value ...] [--link-gbps G]`: validate a GPU run config and print its
placement, parallel groups, per-GPU memory estimate and bytes and seconds per weight sync
(`moe_rl.plan.planner`; with `sync.delta.enabled` the delta's too). Starts nothing; exit code 2 with
the reason (`moe-rl: error: ...`) when the config cannot run. `--link-gbps G` models trainer and
engines in two datacentres joined by one link of G Gb/s."""

from __future__ import annotations

COMMAND = ("plan",)
HELP = "check a cluster config: placement, parallel groups, memory per GPU, sync bytes and seconds"


def add_arguments(parser) -> None:
    parser.add_argument("config", help="YAML run config with a cluster section (see configs/models/)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.ep=16 cluster.nodes=4")
    parser.add_argument(
        "--link-gbps",
        type=float,
        default=None,
        help="trainer and engines in two datacentres joined by one link of this many Gb/s (e.g. 10): "
        "every byte of the sync crosses it once",
    )


def run(args) -> int:
    # heavy: torch (through moe_rl.config); the CLI imports every command module to build its parser
    from moe_rl.config import load_config
    from moe_rl.plan.planner import make_plan

    print(make_plan(load_config(args.config, args.overrides), link_gbps=args.link_gbps).render())
    return 0
