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

LAYOUTS = FOUR_RANK_LAYOUTS + [ParallelLayout(world_size=4, tp=2, pp=2, ep=2, etp=1, sequence_parallel=True)]


def mixtral_config():
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=200,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        architectures=["MixtralForCausalLM"],
    )


def glm4_moe_config():
    from transformers import Glm4MoeConfig

    return Glm4MoeConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.5,
        attention_bias=True,
        use_qk_norm=True,
        architectures=["Glm4MoeForCausalLM"],
    )


@pytest.mark.parametrize("make_config", [mixtral_config, glm4_moe_config], ids=["mixtral", "glm4_moe"])
def test_roundtrip_and_logits(tmp_path, make_config):
    hf_dir = save_tiny_hf_model(make_config(), tmp_path / "hf")
    vocab = make_config().vocab_size
    tokens = torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    per_rank = spawn(check_layouts, 4, str(hf_dir), LAYOUTS, tokens, 4096)
    assert_layout_results(per_rank, hf_dir, hf_reference(hf_dir, tokens), tokens)
