"""Mixtral (vocab 200: padded to 256 on the Megatron side) and GLM-4.5 (Glm4Moe: q/k/v bias,
q/k norm, partial RoPE, first layer dense, shared expert, sigmoid router with correction bias,
routed scaling): import -> export bit-exact and logits equal transformers' under every
layout of one 4-rank world (1, TP2, PP2, EP2, TP2xEP2 SP, PP2xEP2, EP2xETP2, TP2xPP2xEP2)."""

from __future__ import annotations

import pytest
import torch
from test_bridge_harness import BATCH, SEQ, assert_layout_results, check_layouts, hf_reference, save_tiny_hf_model
from test_bridge_qwen3_moe import FOUR_RANK_LAYOUTS

from parallel.layout import ParallelLayout
from parallel.world import spawn
from tests.tiny_models import GLM4_MOE, MIXTRAL, hf_config

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

LAYOUTS = FOUR_RANK_LAYOUTS + [ParallelLayout(world_size=4, tp=2, pp=2, ep=2, etp=1, sequence_parallel=True)]


def mixtral_config():
    return hf_config(MIXTRAL, vocab_size=200)


def glm4_moe_config():
    return hf_config(GLM4_MOE)


@pytest.mark.parametrize("make_config", [mixtral_config, glm4_moe_config], ids=["mixtral", "glm4_moe"])
def test_roundtrip_and_logits(tmp_path, make_config):
    hf_dir = save_tiny_hf_model(make_config(), tmp_path / "hf")
    vocab = make_config().vocab_size
    tokens = torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    per_rank = spawn(check_layouts, 4, str(hf_dir), LAYOUTS, tokens, 4096)
    assert_layout_results(per_rank, hf_dir, hf_reference(hf_dir, tokens), tokens)
