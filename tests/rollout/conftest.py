"""Fixtures for rollout tests: tiny random Qwen3-MoE checkpoints and a real embedded engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_rl.engine.process import EmbeddedConfig, launch_embedded
from tests.tiny_models import QWEN3_MOE_SMALL, hf_config, save_random_model

LAYERS, TOPK = 2, 2


def save_tiny_qwen3(path: Path, seed: int) -> Path:
    """The shared small Qwen3-MoE (tests/tiny_models.py), random from `seed`, in float32."""
    config = hf_config(
        QWEN3_MOE_SMALL, num_hidden_layers=LAYERS, num_experts_per_tok=TOPK, max_position_embeddings=1024
    )
    return save_random_model(config, path, seed)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Two different random checkpoints of the same tiny model (weights v0 and v1)."""
    root = tmp_path_factory.mktemp("tiny_qwen3")
    return save_tiny_qwen3(root / "a", seed=0), save_tiny_qwen3(root / "b", seed=1)


@pytest.fixture(scope="module")
def engine(model_dirs):
    with launch_embedded(EmbeddedConfig(model_path=model_dirs[0], weight_version="0", threads=1)) as process:
        yield process
