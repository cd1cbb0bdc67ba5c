"""`moe-rl bench sync CONFIG [--output FILE]`: the full weight sync of a real Megatron export against
a raw broadcast of the same bytes (`moe_rl.bench.sync`), or with a `lora:` section adapter against
full-weight sync on one engine (`moe_rl.bench.lora`), or with a `delta:` section what delta sync
sends at RL learning rates (`moe_rl.bench.delta`). CONFIG: `moe_rl.bench.options.SyncBench`'s
fields, e.g. configs/bench/sync_1g.yaml."""

from __future__ import annotations

import dataclasses

COMMAND = ("bench", "sync")
HELP = "Benchmark the weight sync of a Megatron export against a raw broadcast of the same bytes."


def add_arguments(parser) -> None:
    parser.add_argument(
        "config", help="YAML: model, layout, bucket_mb, export_bucket_mb, num_engines, repeats, lora or delta, output"
    )
    parser.add_argument("--output", default=None, help="where the JSON goes (overrides the config's output)")


def run(args) -> int:
    # heavy: torch and megatron-core (the CLI imports every command module to build its parser)
    from moe_rl.bench import delta, lora, sync
    from moe_rl.bench.options import SyncBench
    from moe_rl.config import load_config

    options = load_config(args.config, cls=SyncBench)
    if args.output:
        options = dataclasses.replace(options, output=args.output)
    bench = delta if options.delta is not None else lora if options.lora is not None else sync
    bench.show(bench.run(options), options.output_path)
    return 0
