"""`moe-rl bench async CONFIG`: what asynchrony and partial rollouts buy, measured end to end: six
full RL runs of CONFIG (sync vs fully_async, balanced and unbalanced; drain-before-sync vs partial
rollouts under long tails; or sync vs fully_async on an agent task). `moe_rl.bench.asynchrony`
runs them and says how."""

from __future__ import annotations

import argparse

from moe_rl.bench.options import AsyncBench
from moe_rl.commands import options_from

COMMAND = ("bench", "async")
HELP = (
    "sync vs fully_async speedup (balanced and unbalanced), and partial rollouts vs drain-before-sync under long tails"
)


def add_arguments(parser) -> None:
    parser.add_argument("config", help="RL run config (YAML with a rollout section), e.g. configs/demo_cpu.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted overrides applied to every run")
    parser.add_argument(
        "--steps", type=int, default=AsyncBench.steps, help="RL steps per run (one full bench: ~4-6 min on 2 cores)"
    )
    parser.add_argument(
        "--balanced-max-new-tokens",
        type=int,
        default=AsyncBench.balanced_max_new_tokens,
        help="response length of the balanced workload (generation ~ training in sync mode)",
    )
    parser.add_argument("--long-tail-max-new-tokens", type=int, default=AsyncBench.long_tail_max_new_tokens)
    parser.add_argument(
        "--num-stop-tokens",
        type=int,
        default=AsyncBench.num_stop_tokens,
        help="stop tokens of the long-tailed task (8 of 256: mean length ~27, ~17%% run to the budget)",
    )
    parser.add_argument(
        "--long-tail-staleness",
        type=int,
        default=AsyncBench.long_tail_staleness,
        help="staleness bound of the partial-rollout run (drain-before-sync is always 1); "
        "2 carries stragglers over into the next step",
    )
    parser.add_argument(
        "--pools",
        action=argparse.BooleanOptionalAction,
        default=AsyncBench.pools,
        help="disjoint CPU pools: one trainer rank and one engine on cores of their own "
        "(default: on with >= 2 cores, unless CONFIG sets cpu_pools)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=AsyncBench.repeats,
        help="run every pair this many times; ratios are then medians with their range",
    )
    parser.add_argument(
        "--tool-latency-s",
        type=float,
        default=AsyncBench.tool_latency_s,
        help="agent configs: seconds each tool call takes (the task option latency_s)",
    )
    parser.add_argument("--output", default=AsyncBench.output)


def run(args) -> int:
    options = options_from(AsyncBench, args)
    # heavy: torch and Ray (the RL job); the CLI imports every command module to build its parser
    from moe_rl.bench import asynchrony

    asynchrony.run(options)
    return 0
