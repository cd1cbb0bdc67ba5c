"""Qwen3-MoE with YaRN rope scaling: megatron-core's rotary embedding equals transformers' for every
way an HF config states YaRN, and the bridged model's logits equal transformers' at positions past
original_max_position_embeddings, its weights round-tripping bit-exact, under TP, PP and EP."""

from __future__ import annotations

import pytest
import torch
from test_bridge_harness import BATCH, assert_layout_results, check_layouts, hf_reference, save_tiny_hf_model

from parallel.bridges import bridge_for
from parallel.bridges.rope import max_positions, yarn
from parallel.layout import ParallelLayout
from parallel.world import spawn
from tests.tiny_models import QWEN3_MOE, hf_config

pytestmark = pytest.mark.world  # starts processes: a gloo world (megatron-core 0.19 runs git at import)

ORIGINAL, FACTOR = 8, 4.0
"""A tiny model's pretraining positions and YaRN factor: the tests run 4 x 8 = 32 positions."""
SEQ = int(ORIGINAL * FACTOR)


def yarn_config(**rope):
    parameters = dict(rope_type="yarn", rope_theta=10000.0, factor=FACTOR, original_max_position_embeddings=ORIGINAL)
    return hf_config(
        QWEN3_MOE, mlp_only_layers=[0], max_position_embeddings=SEQ, rope_parameters={**parameters, **rope}
    )


VARIANTS = {
    "default_attention_factor": dict(),
    "mscale_ratio": dict(mscale=1.0, mscale_all_dim=0.5),
    "mscale_without_all_dim": dict(mscale=2.0),  # transformers ignores mscale alone: 0.1 ln(factor) + 1
    "explicit_attention_factor": dict(attention_factor=1.5, beta_fast=16.0, beta_slow=2.0),
    "not_truncated": dict(truncate=False, beta_fast=0.5, beta_slow=0.05),  # a ramp off whole dimensions
    "factor_from_positions": dict(factor=None),  # max_position_embeddings / original
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_yarn_rotary_embedding_equals_transformers(variant, cpu_patches):
    """cos and sin (attention factor included) at every position, GPTModel's YaRN rotary embedding
    built from the bridge's config as GPTModel builds it, against transformers' Qwen3-MoE one."""
    from megatron.core.models.common.embeddings import YarnRotaryEmbedding
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor_from_config,
    )
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding

    hf = yarn_config(**VARIANTS[variant])
    bridge = bridge_for(hf)
    config = bridge.transformer_config(ParallelLayout(world_size=1))
    assert bridge.gpt_model_kwargs(ParallelLayout(world_size=1))["position_embedding_type"] == "yarn"
    rotary = YarnRotaryEmbedding(
        kv_channels=config.kv_channels,
        rotary_base=bridge.rope_theta,
        scaling_factor=config.yarn_rotary_scaling_factor,
        original_max_position_embeddings=config.yarn_original_max_position_embeddings,
        beta_fast=config.yarn_beta_fast,
        beta_slow=config.yarn_beta_slow,
        mscale=config.yarn_mscale,
        mscale_all_dim=config.yarn_mscale_all_dim,
        correction_range_round_to_int=config.yarn_correction_range_round_to_int,
        use_cpu_initialization=True,
    )
    emb, _ = rotary(SEQ)  # [s, 1, 1, head_dim]; the attention scales cos and sin by the config's factor
    mscale = _yarn_get_concentration_factor_from_config(config)
    positions = torch.arange(SEQ)[None]
    cos, sin = Qwen3MoeRotaryEmbedding(hf)(torch.zeros(1, dtype=torch.float32), positions)
    # one float32 rounding apart at most: megatron's factor is transformers' solved through yarn_mscale
    tolerance = 2 * torch.finfo(torch.float32).eps * yarn(hf).attention_factor
    assert mscale == pytest.approx(yarn(hf).attention_factor, rel=1e-12)
    torch.testing.assert_close(emb[:, 0, 0].cos() * mscale, cos[0], rtol=0, atol=tolerance)
    torch.testing.assert_close(emb[:, 0, 0].sin() * mscale, sin[0], rtol=0, atol=tolerance)


def test_yarn_as_published_config_json_states_it():
    """Qwen3's config.json names it `rope_scaling` (`type` in older files); the positions it covers are
    factor x original_max_position_embeddings, beyond max_position_embeddings."""
    published = dict(
        architectures=["Qwen3MoeForCausalLM"],
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=32768),
    )
    scaled = yarn(published)
    assert (scaled.factor, scaled.original_max_position_embeddings, scaled.scaled_positions) == (4.0, 32768, 131072)
    assert max_positions(published) == 131072
    assert max_positions({**published, "rope_scaling": None}) == 40960
    assert bridge_for(published).rope_theta == 1000000.0


@pytest.mark.parametrize(
    "rope, message",
    [
        (
            dict(rope_type="linear", factor=2.0),
            r"rope_type='linear': the Qwen3-MoE bridge supports 'default' and 'yarn'",
        ),
        (dict(rope_type="yarn", factor=1.0, original_max_position_embeddings=8), r"YaRN needs a factor > 1"),
        (dict(rope_type="yarn", factor=4.0, partial_rotary_factor=0.5), r"partial_rotary_factor=0.5"),
    ],
)
def test_unsupported_rope_is_a_clear_error(rope, message):
    fields = dict(QWEN3_MOE, rope_parameters=dict(rope_theta=10000.0, **rope))
    with pytest.raises(ValueError, match=message):
        bridge_for(fields).transformer_config_kwargs()


LAYOUTS = [
    ParallelLayout(world_size=2, tp=2, sequence_parallel=True),
    ParallelLayout(world_size=2, pp=2),
    ParallelLayout(world_size=2, ep=2),
]


def test_qwen3_yarn_roundtrip_and_logits(tmp_path):
    """All 32 positions (24 past the 8 pretrained ones): logits within the bridge tests' 1e-4 of
    transformers', which YaRN moves by far more than that."""
    hf_dir = save_tiny_hf_model(yarn_config(mscale=1.0, mscale_all_dim=0.5), tmp_path / "yarn")
    plain_dir = save_tiny_hf_model(hf_config(QWEN3_MOE, mlp_only_layers=[0]), tmp_path / "plain")  # same seed
    tokens = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    reference = hf_reference(hf_dir, tokens)
    assert (reference - hf_reference(plain_dir, tokens)).abs().max() > 1e-2
    per_rank = spawn(check_layouts, 2, str(hf_dir), LAYOUTS, tokens, 4096)
    assert len(assert_layout_results(per_rank, hf_dir, reference, tokens)) == len(LAYOUTS)


def _cp_logprobs(hf_dir: str, tokens: torch.Tensor, layout: dict) -> torch.Tensor:
    """Rank function: the trainer's logprobs of `tokens` (natural routing) under `layout`."""
    from moe_rl.config import TrainerConfig
    from moe_rl.trainer.megatron_trainer import MegatronTrainer
    from parallel.hf_checkpoint import load_hf_config

    config = TrainerConfig(world_size=2, **layout, micro_batch_size=BATCH, global_batch_size=BATCH)
    trainer = MegatronTrainer(config, load_hf_config(hf_dir))
    trainer.load_hf_weights(hf_dir)
    return trainer.forward_logprobs({"tokens": tokens, "loss_mask": torch.ones_like(tokens)}).numpy().copy()


@pytest.mark.parametrize("layout", [{"cp": 2}, {"cp": 2, "ep": 2}], ids=["cp2", "cp2xep2"])
def test_qwen3_yarn_under_context_parallelism(tmp_path, layout):
    """CP splits each row into 2 x cp chunks; megatron-core's YaRN rotary embedding takes each CP
    rank's positions (`get_pos_emb_on_this_cp_rank`), so every position past the pretrained 8 keeps
    transformers' rotation: logprobs within 2e-4 of transformers' (a log-softmax moves at most twice
    the logits' 1e-4)."""
    hf_dir = save_tiny_hf_model(yarn_config(), tmp_path / "yarn")
    tokens = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    expected = torch.log_softmax(hf_reference(hf_dir, tokens)[:, :-1], dim=-1).gather(-1, tokens[:, 1:, None])[..., 0]
    for logprobs in spawn(_cp_logprobs, 2, str(hf_dir), tokens, layout):
        assert float((torch.from_numpy(logprobs) - expected).abs().max()) <= 2e-4
