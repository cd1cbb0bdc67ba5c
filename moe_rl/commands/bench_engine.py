"""`moe-rl bench engine`: concurrent vs serial generation on one engine, and transformers' own
batched `generate()` at equal batch as the baseline (`moe_rl.bench.engine` runs it)."""

from __future__ import annotations

import argparse
import json

from moe_rl.bench.options import EngineBench
from moe_rl.commands import options_from

COMMAND = ("bench", "engine")
HELP = (
    "measure an engine's continuous batching: N concurrent requests vs the same N serially and vs "
    "transformers' generate() at batch N"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-dir", help="HF MoE model directory (default: a tiny random Qwen3-MoE)")
    parser.add_argument("--url", help="benchmark a running engine instead of starting one")
    parser.add_argument("--requests", type=int, default=EngineBench.requests)
    parser.add_argument("--prompt-len", type=int, default=EngineBench.prompt_len)
    parser.add_argument("--max-new-tokens", type=int, default=EngineBench.max_new_tokens)
    parser.add_argument(
        "--repeats", type=int, default=EngineBench.repeats, help="concurrent + generate() pairs; the best is shown"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON line instead of a table")


def run(args: argparse.Namespace) -> int:
    options = options_from(EngineBench, args)
    # heavy: torch and the engine (the CLI imports every command module to build its parser)
    from moe_rl.bench import engine

    report = engine.run(options)
    if args.json:
        print(json.dumps(report))
    else:
        engine.show(report)
    return 0
