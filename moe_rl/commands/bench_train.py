"""`moe-rl bench train CONFIG [--lengths SPEC] [--steps N]`: the trainer's throughput on a
long-tailed RL batch, padded micro-batches against token-budget ones (`moe_rl.bench.train`)."""

from __future__ import annotations

from moe_rl.bench.options import TrainBench
from moe_rl.commands import options_from

COMMAND = ("bench", "train")
HELP = "trainer throughput on long-tailed RL batches: padded vs token-budget micro-batches"


def add_arguments(parser) -> None:
    parser.add_argument("config", help="run config with trainer.max_tokens_per_microbatch (configs/bench/train_*.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.max_tokens_per_microbatch=2048")
    parser.add_argument(
        "--lengths", default=TrainBench.lengths, help="rows=512,prompt=16,median=48,cap=384,sigma=1.0,seed=0 (any)"
    )
    parser.add_argument(
        "--steps", type=int, default=TrainBench.steps, help="timed train steps per path, after one warm-up"
    )
    parser.add_argument("--output", default=TrainBench.output, help="where the JSON goes")


def run(args) -> int:
    options = options_from(TrainBench, args)
    # heavy: torch and megatron-core (the CLI imports every command module to build its parser)
    from moe_rl.bench import train

    train.run(options)
    return 0
