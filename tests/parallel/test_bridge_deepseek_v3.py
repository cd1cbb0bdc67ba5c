"""DeepSeek-V3 bridge (MLA with q/kv LoRA and interleaved RoPE rows, first layer dense, shared
expert, sigmoid router with correction bias, group-limited top-k, routed scaling): import ->
export bit-exact and logits equal transformers' within 1e-4 under seven layouts of one 4-rank
world and TP2xPP2xEP2 on 8 ranks; variants without q LoRA, with YaRN, with `rope_interleave=false`."""

from __future__ import annotations

import pytest
import torch
from test_bridge_harness import BATCH, SEQ, assert_layout_results, check_layouts, hf_reference, save_tiny_hf_model
from test_bridge_qwen3_moe import EIGHT_RANK_LAYOUTS, FOUR_RANK_LAYOUTS

from parallel.bridges.deepseek_v3 import megatron_at_least
from parallel.layout import ParallelLayout
from parallel.world import spawn
from tests.tiny_models import DEEPSEEK_V3, hf_config

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)


def deepseek_v3_config(**overrides):
    return hf_config(DEEPSEEK_V3, **overrides)


YARN = dict(
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=4.0,
        original_max_position_embeddings=64,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=0.5,
    )
)
VARIANTS = {
    "mla": (dict(), 4, FOUR_RANK_LAYOUTS),
    "mla_8ranks": (dict(), 8, EIGHT_RANK_LAYOUTS),
    "no_q_lora_yarn": (dict(q_lora_rank=None, **YARN), 4, FOUR_RANK_LAYOUTS[:2] + FOUR_RANK_LAYOUTS[-2:]),
    "not_interleaved": (dict(rope_interleave=False), 4, FOUR_RANK_LAYOUTS[1:2]),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_deepseek_v3_roundtrip_and_logits(tmp_path, variant):
    overrides, world_size, layouts = VARIANTS[variant]
    if "q_lora_rank" in overrides and megatron_at_least(0, 19):
        pytest.skip("no-q-LoRA MLA needs megatron-core < 0.19 (see test_unsupported_configs_are_clear_errors)")
    hf_dir = save_tiny_hf_model(deepseek_v3_config(**overrides), tmp_path / "hf")
    tokens = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    per_rank = spawn(check_layouts, world_size, str(hf_dir), layouts, tokens, 4096)
    losses = assert_layout_results(per_rank, hf_dir, hf_reference(hf_dir, tokens), tokens)
    assert len(losses) == len(layouts)


def test_unsupported_configs_are_clear_errors():
    from parallel.bridges import bridge_for

    if megatron_at_least(0, 19):
        with pytest.raises(ValueError, match="q_lora_rank=null needs megatron-core < 0.19"):
            bridge_for(deepseek_v3_config(q_lora_rank=None)).transformer_config(ParallelLayout(world_size=1))

    with pytest.raises(ValueError, match="attention_bias=true"):
        bridge_for(deepseek_v3_config(attention_bias=True)).transformer_config(ParallelLayout(world_size=1))
    with pytest.raises(ValueError, match="kv_lora_rank \\+ qk_rope_head_dim=30 is not divisible by tp=4"):
        bridge_for(deepseek_v3_config(kv_lora_rank=22)).transformer_config(
            ParallelLayout(world_size=4, tp=4, sequence_parallel=True)
        )
