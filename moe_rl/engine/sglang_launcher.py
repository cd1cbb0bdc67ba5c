"""Launch SGLang (`python -m sglang.launch_server`) with what RL needs (GPU machines only).

Flags (SGLang 0.5.23 server args): `--skip-tokenizer-init` (we send `input_ids`),
`--enable-return-routed-experts` (routing replay), `--tp-size/--ep-size/--dp-size`,
`--mem-fraction-static`, `--weight-version` (the initial version), `--enable-memory-saver` (colocated
mode: release/resume memory around training). The process is an `EngineProcess`: it waits for
`/health`, keeps its log, and stops with SIGTERM then SIGKILL. sglang is never imported here.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from moe_rl.engine.process import EngineProcess, free_port


@dataclasses.dataclass(kw_only=True)
class SGLangConfig:
    model_path: str
    """HF model directory or hub name SGLang loads."""
    host: str = "127.0.0.1"
    port: int | None = None
    """HTTP port; None picks a free one."""
    tp_size: int = 1
    ep_size: int = 1
    dp_size: int = 1
    mem_fraction_static: float = 0.8
    """Fraction of GPU memory for weights + KV cache (lower it when colocated with the trainer)."""
    weight_version: str = "0"
    enable_return_routed_experts: bool = True
    enable_memory_saver: bool = False
    """Colocated mode: lets the trainer release/resume the engine's GPU memory."""
    base_gpu_id: int = 0
    extra_args: list[str] = dataclasses.field(default_factory=list)
    """Passed through verbatim (e.g. ["--attention-backend", "fa3"])."""

    def __post_init__(self):
        for name in ("tp_size", "ep_size", "dp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.ep_size > self.tp_size * self.dp_size:
            raise ValueError(f"ep_size={self.ep_size} exceeds tp_size*dp_size={self.tp_size * self.dp_size}")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static={self.mem_fraction_static} must be in (0, 1)")


def sglang_command(config: SGLangConfig, port: int) -> list[str]:
    command = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", config.model_path, "--host", config.host, "--port", str(port),
        "--tp-size", str(config.tp_size), "--ep-size", str(config.ep_size), "--dp-size", str(config.dp_size),
        "--mem-fraction-static", str(config.mem_fraction_static), "--weight-version", config.weight_version,
        "--base-gpu-id", str(config.base_gpu_id), "--skip-tokenizer-init",
    ]
    if config.enable_return_routed_experts:
        command.append("--enable-return-routed-experts")
    if config.enable_memory_saver:
        command.append("--enable-memory-saver")
    return command + list(config.extra_args)


def launch_sglang(config: SGLangConfig, log_path: str | Path | None = None, timeout_s: float = 900.0,
                  env: dict[str, str] | None = None) -> EngineProcess:
    """Start SGLang and wait for `/health` (model loading and CUDA graphs can take minutes).
    `env` adds to the process environment (e.g. CUDA_VISIBLE_DEVICES of colocated engines)."""
    port = config.port or free_port(config.host)
    return EngineProcess(sglang_command(config, port), config.host, port, log_path, env=env).wait_healthy(timeout_s)
