"""DeepSeek-V3 class (DeepseekV3): Multi-Latent Attention (low-rank q and kv projections with
RMSNorm on the latents, a decoupled rotary part shared by all heads, q/k wider than v), the
first `first_k_dense_replace` layers dense, then MoE layers with shared experts and a sigmoid
router with expert-score correction bias, group-limited top-k and `routed_scaling_factor`.

RoPE: Megatron's MLA rotates interleaved rotary rows, as checkpoints with
`rope_interleave=true` (DeepSeek's own) store them; with `rope_interleave=false` the rotary
rows of q_b_proj / q_proj and kv_a_proj_with_mqa are permuted on import (`RopeRows`). YaRN
(`rope_parameters.rope_type == "yarn"`) maps to Megatron's YaRN rope, whose softmax scale
carries mscale(factor, mscale_all_dim)^2 as transformers' does.
"""

from __future__ import annotations

from typing import Any

from parallel.bridges.base import Bridge, register
from parallel.bridges.glm4_moe import routed_and_shared_expert_mappings, sigmoid_router_kwargs
from parallel.bridges.rope import rope_parameters
from parallel.mappings import ColumnParallel, Replicated, RopeRows, RowParallel


def megatron_at_least(major: int, minor: int) -> bool:
    # heavy: megatron-core, loaded only where a model is built (after parallel.cpu_compat.apply)
    from megatron.core import package_info

    return tuple(int(part) for part in package_info.__version__.split(".")[:2]) >= (major, minor)


@register
class DeepseekV3Bridge(Bridge):
    architectures = ("DeepseekV3ForCausalLM",)
    has_expert_bias = True
    aux_loss_type = "seq_aux_loss"  # DeepSeek-V3's complementary sequence-wise balance loss

    @property
    def num_experts(self) -> int:
        return int(self.get("n_routed_experts"))

    @property
    def q_lora_rank(self) -> int | None:
        return self.get("q_lora_rank", None)

    @property
    def num_query_groups(self) -> int:
        return int(self.get("num_attention_heads"))  # MLA: every head has its own k/v

    def megatron_config_class(self):
        # heavy: megatron-core, loaded only where a model is built (after parallel.cpu_compat.apply)
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        return MLATransformerConfig

    def rope_kwargs(self) -> dict[str, Any]:
        rope = rope_parameters(self.hf)  # `rope_scaling` of DeepSeek's published config.json too
        kind = rope["rope_type"]
        if kind == "default":
            return dict(rope_type="rope", rotary_base=self.rope_theta)
        if kind != "yarn":
            raise ValueError(
                f"rope_parameters.rope_type={kind!r}: the DeepSeek-V3 bridge supports 'default' and 'yarn'"
            )
        return dict(
            rope_type="yarn",
            rotary_base=self.rope_theta,
            rotary_scaling_factor=float(rope["factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            beta_fast=float(rope.get("beta_fast", 32)),
            beta_slow=float(rope.get("beta_slow", 1)),
            mscale=float(rope.get("mscale", 1.0)),
            mscale_all_dim=float(rope.get("mscale_all_dim", 0.0)),
        )

    def moe_layer_pattern(self) -> list[int]:
        return [int(i >= self.get("first_k_dense_replace")) for i in range(self.get("num_hidden_layers"))]

    def transformer_config_kwargs(self) -> dict[str, Any]:
        if self.get("attention_bias", False):
            raise ValueError(
                "DeepSeek-V3 with attention_bias=true is not supported by this bridge: "
                "Megatron's MLA projections have no bias"
            )
        if self.q_lora_rank is None and megatron_at_least(0, 19):
            raise ValueError(
                "DeepSeek-V3 with q_lora_rank=null needs megatron-core < 0.19: 0.19+ builds MLA's q "
                "projection without q LoRA only as a fused norm+linear, a q norm the HF model lacks"
            )
        heads = self.get("num_attention_heads")
        return dict(
            num_layers=self.get("num_hidden_layers"),
            hidden_size=self.get("hidden_size"),
            num_attention_heads=heads,
            num_query_groups=heads,
            kv_channels=self.get("v_head_dim"),
            ffn_hidden_size=self.get("intermediate_size"),
            normalization="RMSNorm",
            layernorm_epsilon=float(self.get("rms_norm_eps")),
            qk_layernorm=True,  # MLA's latent norms (q_a_layernorm, kv_a_layernorm)
            multi_latent_attention=True,
            q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.get("kv_lora_rank"),
            qk_head_dim=self.get("qk_nope_head_dim"),
            qk_pos_emb_head_dim=self.get("qk_rope_head_dim"),
            v_head_dim=self.get("v_head_dim"),
            moe_layer_freq=self.moe_layer_pattern(),
            **self.rope_kwargs(),
            **sigmoid_router_kwargs(self),
        )

    def transformer_config(self, layout, router=None, **overrides):
        latent = self.get("kv_lora_rank") + self.get("qk_rope_head_dim")
        for field, rows in (("q_lora_rank", self.q_lora_rank), ("kv_lora_rank + qk_rope_head_dim", latent)):
            if rows is not None and rows % layout.tp:
                raise ValueError(
                    f"{field}={rows} is not divisible by tp={layout.tp}: the local spec splits "
                    f"MLA's down projections over TP; pick a tp that divides it"
                )
        return super().transformer_config(layout, router, **overrides)

    def layer_spec(self, config, use_te: bool, vp_stage: int | None = None):
        # heavy: megatron-core, loaded only where a model is built (after parallel.cpu_compat.apply)
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        spec = get_gpt_decoder_block_spec(
            config, use_transformer_engine=use_te, normalization="RMSNorm", vp_stage=vp_stage
        )
        if not use_te:  # the local spec's DotProductAttention cannot take MLA's head sizes
            # heavy: the eager attention module imports megatron-core at its top
            from parallel.eager_attention import use_eager_attention

            use_eager_attention(spec)
        return spec

    def mappings(self, te: bool = False) -> tuple:
        return self.with_mtp(
            (
                *self.common_mappings(te),
                *self.mla_mappings(te),
                *self.dense_mlp_mappings(),
                *routed_and_shared_expert_mappings(self, te),
            )
        )

    def mla_mappings(self, te: bool) -> tuple:
        """Local spec: the down projections are column-parallel (output rows split over TP, then
        gathered) and the latent norms are modules of their own. TE spec: the down projections
        are duplicated TELinear and the latent norms fuse into the up projections."""
        attn, hf = "decoder.layers.*.self_attention", "model.layers.*.self_attn"
        nope, rope = self.get("qk_nope_head_dim"), self.get("qk_rope_head_dim")
        interleaved = bool(self.get("rope_interleave", True))
        q_rows = dict(block=nope + rope, rope=rope, hf_interleaved=interleaved)
        kv_rows = dict(block=self.get("kv_lora_rank") + rope, rope=rope, hf_interleaved=interleaved, split=not te)
        norm = "{}.layer_norm_weight" if te else "{}_layernorm.weight"
        table = [
            RopeRows(f"{attn}.linear_kv_down_proj.weight", f"{hf}.kv_a_proj_with_mqa.weight", **kv_rows),
            Replicated(f"{attn}.{norm.format('linear_kv_up_proj' if te else 'kv')}", f"{hf}.kv_a_layernorm.weight"),
            ColumnParallel(f"{attn}.linear_kv_up_proj.weight", f"{hf}.kv_b_proj.weight"),
            RowParallel(f"{attn}.linear_proj.weight", f"{hf}.o_proj.weight"),
        ]
        if self.q_lora_rank is None:
            return (*table, RopeRows(f"{attn}.linear_q_proj.weight", f"{hf}.q_proj.weight", **q_rows))
        down = Replicated if te else ColumnParallel
        return (
            *table,
            down(f"{attn}.linear_q_down_proj.weight", f"{hf}.q_a_proj.weight"),
            Replicated(f"{attn}.{norm.format('linear_q_up_proj' if te else 'q')}", f"{hf}.q_a_layernorm.weight"),
            RopeRows(f"{attn}.linear_q_up_proj.weight", f"{hf}.q_b_proj.weight", **q_rows),
        )
