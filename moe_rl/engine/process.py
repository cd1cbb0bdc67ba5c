"""Engine server processes: start one, wait for `/health`, keep its log, stop it cleanly.

`launch_embedded(EmbeddedConfig(model_path=...))` starts `python -m moe_rl.cli serve MODEL_DIR` (the
embedded CPU engine) on a free port; `moe_rl.engine.sglang_launcher` builds the
`sglang.launch_server` command line from its `SGLangConfig` the same way and uses the same
`EngineProcess`. Tests and the orchestrator use these; the returned object's `url`
is what `EngineClient` takes.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class EngineProcess:
    """A running engine server; `stop()` (or the context manager) ends it, SIGTERM then SIGKILL."""

    def __init__(
        self,
        command: list[str],
        host: str,
        port: int,
        log_path: str | Path | None = None,
        env: dict[str, str] | None = None,
    ):
        self.command, self.host, self.port = command, host, port
        self.url = f"http://{host}:{port}"
        self.log_path = Path(log_path or tempfile.mkstemp(prefix="engine-", suffix=".log")[1])
        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )

    def wait_healthy(self, timeout_s: float) -> "EngineProcess":
        """Poll GET /health until 200; raise RuntimeError with the log's tail if it dies or times out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.stop()
                raise RuntimeError(f"engine exited with code {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"engine at {self.url} not healthy after {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        if not self._log.closed:  # `stop()` closes it; the file keeps what the engine wrote
            self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log.close()

    def __enter__(self) -> "EngineProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


@dataclasses.dataclass(kw_only=True)
class EmbeddedConfig:
    """How the embedded engine runs (`launch_embedded`; `moe-rl serve` takes the same as flags)."""

    model_path: str | Path
    """HF MoE model directory (config.json + *.safetensors)."""
    host: str = "127.0.0.1"
    port: int | None = None
    """HTTP port; None picks a free one."""
    weight_version: str = "0"
    """The label of the launch weights."""
    max_batch: int = 64
    """Most requests decoded together."""
    device: str = "cpu"
    """Where the model runs: cpu, or cuda / cuda:N."""
    threads: int | None = None
    """torch's threads in the engine process (OMP_NUM_THREADS); None: one per core of `cpus`, else
    torch's default."""
    cpus: list[int] | None = None
    """Pin the engine's process to these cores (`cpu_pools.engines[i]`); None: no pinning."""
    speculative_steps: int = 0
    """Speculative decoding with the checkpoint's MTP layer: draft tokens per verifying forward
    (`engines.speculative.steps`); 0: none."""

    def __post_init__(self):
        if not (Path(self.model_path) / "config.json").is_file():
            raise ValueError(f"model_path: {self.model_path} has no config.json; pass an HF model directory")
        if self.max_batch < 1:
            raise ValueError(f"max_batch={self.max_batch}: must be >= 1")
        if self.speculative_steps < 0:
            raise ValueError(f"speculative_steps={self.speculative_steps}: must be >= 0 (0: no speculation)")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads={self.threads}: must be >= 1, or None")


def embedded_command(config: EmbeddedConfig, port: int) -> list[str]:
    command = [sys.executable, "-m", "moe_rl.cli", "serve", str(config.model_path), "--host", config.host]
    command += ["--port", str(port), "--weight-version", str(config.weight_version)]
    command += ["--max-batch", str(config.max_batch), "--device", config.device]
    if config.cpus:
        command += ["--cpus", ",".join(map(str, config.cpus))]
    if config.speculative_steps:
        command += ["--speculative-steps", str(config.speculative_steps)]
    return command


def launch_embedded(
    config: EmbeddedConfig, log_path: str | Path | None = None, timeout_s: float = 120.0
) -> EngineProcess:
    """Start the embedded engine as a subprocess and wait until it is healthy."""
    port = config.port or free_port(config.host)
    root = str(Path(__file__).resolve().parents[2])  # this checkout, installed or not
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    threads = config.threads or (len(config.cpus) if config.cpus else None)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return EngineProcess(embedded_command(config, port), config.host, port, log_path, env).wait_healthy(timeout_s)
