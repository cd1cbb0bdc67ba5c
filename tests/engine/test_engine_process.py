"""The engine process handle: an engine that dies at start-up raises with its exit code and the end
of its own log (how a CUDA engine's start-up error reaches the caller)."""

from __future__ import annotations

import sys

import pytest

from moe_rl.engine.process import EngineProcess, free_port

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)


def test_an_engine_that_exits_at_start_up_raises_with_its_log(tmp_path):
    command = [sys.executable, "-c", "print('no CUDA device here', flush=True); raise SystemExit(3)"]
    engine = EngineProcess(command, "127.0.0.1", free_port(), tmp_path / "engine.log")
    with pytest.raises(RuntimeError, match=r"(?s)engine exited with code 3:.*no CUDA device here"):
        engine.wait_healthy(timeout_s=60)
