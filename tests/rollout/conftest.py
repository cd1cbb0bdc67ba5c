"""Fixtures for rollout tests: tiny random Qwen3-MoE checkpoints and a real embedded engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_rl.engine.process import launch_embedded

LAYERS, TOPK = 2, 2


def save_tiny_qwen3(path: Path, seed: int) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=TOPK,
        norm_topk_prob=True,
        max_position_embeddings=1024,
        architectures=["Qwen3MoeForCausalLM"],
    )
    Qwen3MoeForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Two different random checkpoints of the same tiny model (weights v0 and v1)."""
    root = tmp_path_factory.mktemp("tiny_qwen3")
    return save_tiny_qwen3(root / "a", seed=0), save_tiny_qwen3(root / "b", seed=1)


@pytest.fixture(scope="module")
def engine(model_dirs):
    with launch_embedded(model_dirs[0], weight_version="0", threads=1) as process:
        yield process
