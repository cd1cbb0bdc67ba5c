"""`moe-rl serve MODEL_DIR`: the embedded CPU engine (SGLang's HTTP API around a transformers MoE)."""

from __future__ import annotations

import argparse

from moe_rl.commands import options_from
from moe_rl.cpu_pools import pin_process
from moe_rl.engine.process import EmbeddedConfig

COMMAND = ("serve",)
HELP = "serve an HF MoE model directory with the embedded CPU engine (SGLang's HTTP API)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_path", metavar="MODEL_DIR", help="HF model directory (config.json + *.safetensors)")
    parser.add_argument("--host", default=EmbeddedConfig.host)
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--weight-version", default=EmbeddedConfig.weight_version, help="initial weight version")
    parser.add_argument(
        "--max-batch", type=int, default=EmbeddedConfig.max_batch, help="most requests decoded together"
    )
    parser.add_argument("--device", default=EmbeddedConfig.device, help="where the model runs: cpu, or cuda / cuda:N")
    parser.add_argument(
        "--speculative-steps",
        type=int,
        default=EmbeddedConfig.speculative_steps,
        help="speculative decoding: MTP draft tokens per verifying forward (0: none)",
    )
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
    config = options_from(EmbeddedConfig, args)
    if config.cpus:  # before torch starts its thread pool, so every thread inherits the pinning
        pin_process(config.cpus)
    # heavy: torch and transformers (the engine); the CLI imports every command module to build its parser
    from moe_rl.engine.embedded.server import serve

    serve(config)
    return 0
