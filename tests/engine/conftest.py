"""Fixtures for engine tests: tiny random MoE checkpoints and embedded engines (real subprocesses);
`qwen3_dir` is in tests/conftest.py (the CLI tests use it too)."""

from __future__ import annotations

import pytest

from moe_rl.engine.process import EmbeddedConfig, launch_embedded
from tests.engine.engine_helpers import save_tiny_model


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    return save_tiny_model("mixtral", tmp_path_factory.mktemp("mixtral"))


@pytest.fixture(scope="module")
def qwen3_engine(qwen3_dir):
    # One intra-op thread in every test engine: with two OpenMP threads on two shared cores, a
    # busy machine deschedules one and each op waits for it (a 507-token request went from 2 s
    # to over 60 s with a busy loop per core; with one thread it takes 1 s either way).
    with launch_embedded(EmbeddedConfig(model_path=qwen3_dir, weight_version="0", threads=1)) as engine:
        yield engine
