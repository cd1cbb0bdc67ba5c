"""`moe-rl serve MODEL_DIR`: the embedded CPU engine (SGLang's HTTP API around a transformers MoE)."""

from __future__ import annotations

import argparse
from pathlib import Path

from moe_rl.cpu_pools import pin_process

COMMAND = ("serve",)
HELP = "serve an HF MoE model directory with the embedded CPU engine (SGLang's HTTP API)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", help="HF model directory (config.json + *.safetensors)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--weight-version", default="0", help="initial weight version (integer string)")
    parser.add_argument("--max-batch", type=int, default=64, help="most requests decoded together")
    parser.add_argument("--device", default="cpu", help="where the model runs: cpu, or cuda / cuda:N")
    parser.add_argument(
        "--cpus",
        type=_core_list,
        default=None,
        help="pin the engine to these cores, e.g. 1 or 2,3 (`cpu_pools.engines`)",
    )


def _core_list(text: str) -> list[int]:
    try:
        return [int(core) for core in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: write core ids separated by commas, e.g. 2,3") from None


def run(args: argparse.Namespace) -> int:
    if not (Path(args.model_dir) / "config.json").is_file():
        raise ValueError(f"model_dir: {args.model_dir} has no config.json; pass an HF model directory")
    if args.max_batch < 1:
        raise ValueError("--max-batch must be >= 1")
    if args.cpus:  # before torch starts its thread pool, so every thread inherits the pinning
        pin_process(args.cpus)
    # heavy: torch and transformers (the engine); the CLI imports every command module to build its parser
    from moe_rl.engine.embedded.server import serve

    serve(args.model_dir, args.host, args.port, args.weight_version, args.max_batch, args.device)
    return 0
