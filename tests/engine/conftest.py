"""Fixtures for engine tests: tiny random MoE checkpoints and embedded engines (real subprocesses);
`qwen3_dir` is in tests/conftest.py (the CLI tests use it too)."""

from __future__ import annotations

import pytest

from moe_rl.engine.process import launch_embedded
from tests.engine.engine_helpers import save_tiny_model


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    return save_tiny_model("mixtral", tmp_path_factory.mktemp("mixtral"))


@pytest.fixture(scope="module")
def qwen3_engine(qwen3_dir):
    with launch_embedded(qwen3_dir, weight_version="0") as engine:
        yield engine
