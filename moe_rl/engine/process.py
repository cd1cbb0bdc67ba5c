"""Engine server processes: start one, wait for `/health`, keep its log, stop it cleanly.

`launch_embedded(model_dir)` starts `python -m moe_rl.cli serve MODEL_DIR` (the embedded CPU engine)
on a free port; `moe_rl.engine.sglang_launcher` builds the `sglang.launch_server` command line and
uses the same `EngineProcess`. Tests and the orchestrator use these; the returned object's `url`
is what `EngineClient` takes.
"""

from __future__ import annotations

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


def launch_embedded(
    model_dir: str | Path,
    weight_version: str = "0",
    host: str = "127.0.0.1",
    port: int | None = None,
    max_batch: int = 64,
    log_path: str | Path | None = None,
    timeout_s: float = 120.0,
    threads: int | None = None,
    cpus: list[int] | None = None,
    device: str = "cpu",
) -> EngineProcess:
    """Start the embedded engine as a subprocess on a free port and wait until it is healthy.
    `cpus`: pin it to these cores (`serve --cpus`, one thread per core unless `threads` says)."""
    port = port or free_port(host)
    command = [
        sys.executable,
        "-m",
        "moe_rl.cli",
        "serve",
        str(model_dir),
        "--host",
        host,
        "--port",
        str(port),
        "--weight-version",
        str(weight_version),
        "--max-batch",
        str(max_batch),
        "--device",
        device,
    ]
    if cpus:
        command += ["--cpus", ",".join(map(str, cpus))]
        threads = threads or len(cpus)
    root = str(Path(__file__).resolve().parents[2])  # this checkout, installed or not
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return EngineProcess(command, host, port, log_path, env).wait_healthy(timeout_s)
