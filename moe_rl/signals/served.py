"""A served model other than the policy (a distillation teacher, a judge): started from `path` or
reached at `url`.

`ServedConfig` (`moe_rl.algorithms.config`) is the `{path | url}` a config names. `ServedModel` makes it answer:
- `path`: an engine server on that HF directory, of the run's `engines.kind` (the embedded engine
  on CPU, SGLang with `engines.tp` GPUs), started here and stopped by `stop()`. In an RL run it is a
  Ray actor (`moe_rl.rl.cluster` places it beside the rollout engines: a CPU, or `engines.tp` GPUs);
- `url`: a server someone else runs (SGLang or `moe-rl serve`), checked for `/health`; `stop()`
  leaves it running.
Either way `url()` is what `EngineClient` takes: the teacher and the judge call the same routes
the rollout engines answer (`/generate`, prefill-only scoring), so they are SGLang's too.
"""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

from moe_rl.algorithms.config import ServedConfig
from moe_rl.engine.process import EmbeddedConfig, EngineProcess, launch_embedded


def healthy(url: str, timeout_s: float = 5.0) -> bool:
    """Whether GET `url`/health answers 200 now."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


class ServedModel:
    """One served model (see the module docstring); also the Ray actor class of an RL run's."""

    def __init__(self, config: ServedConfig, engines, log_path: str | Path | None = None, timeout_s: float = 120.0):
        """`engines`: the run's `EngineConfig` (the kind, threads and GPUs a started engine gets)."""
        self.process: EngineProcess | None = None
        if config.url is not None:
            self._url = config.url.rstrip("/")
            deadline = time.monotonic() + timeout_s
            while not healthy(self._url):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"served model at {self._url}: /health does not answer after {timeout_s:.0f} s")
                time.sleep(0.5)
            return
        if engines.kind == "embedded":
            embedded = EmbeddedConfig(model_path=config.path, max_batch=engines.max_batch, threads=engines.threads)
            self.process = launch_embedded(embedded, log_path=log_path, timeout_s=timeout_s)
        else:
            from moe_rl.engine.sglang_launcher import SGLangConfig, launch_sglang  # GPU runs only

            sglang = SGLangConfig(
                model_path=config.path,
                host=socket.gethostbyname(socket.gethostname()),  # reached from other nodes' actors
                tp_size=engines.tp,
                ep_size=engines.ep,
                mem_fraction_static=engines.mem_fraction_static,
            )
            self.process = launch_sglang(sglang, log_path=log_path)
        self._url = self.process.url

    def url(self) -> str:
        return self._url

    def healthy(self) -> bool:
        return healthy(self._url)

    def stop(self) -> None:
        """Stop the engine this started; a server reached by `url` keeps running."""
        if self.process is not None:
            self.process.stop()
