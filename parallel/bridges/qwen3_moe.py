"""Qwen3-MoE: GQA with per-head q/k RMSNorm, RoPE, SwiGLU experts, softmax top-k router
(top-k weights renormalised when `norm_topk_prob`), no shared expert.

Long context: Qwen3's HF config adds YaRN (`rope_scaling` / `rope_parameters` with rope_type "yarn",
e.g. factor 4 over original_max_position_embeddings 32768), which maps to GPTModel's YaRN rotary
embedding (`position_embedding_type="yarn"`, `parallel.bridges.yarn_config`); it holds no weights.
"""

from __future__ import annotations

from typing import Any

from parallel.bridges.base import Bridge, register
from parallel.bridges.rope import Yarn, rope_parameters, yarn
from parallel.mappings import Replicated


@register
class Qwen3MoeBridge(Bridge):
    architectures = ("Qwen3MoeForCausalLM",)

    @property
    def num_experts(self) -> int:
        return int(self.get("num_experts", None) or self.get("num_local_experts"))

    def moe_layer_pattern(self) -> list[int]:
        """1 for an MoE layer, 0 for a dense one (HF `mlp_only_layers`, `decoder_sparse_step`)."""
        dense = set(self.get("mlp_only_layers", None) or [])
        step = int(self.get("decoder_sparse_step", 1) or 1)
        return [int(layer not in dense and (layer + 1) % step == 0) for layer in range(self.get("num_hidden_layers"))]

    @property
    def yarn(self) -> Yarn | None:
        rope = rope_parameters(self.hf)
        if rope["rope_type"] not in ("default", "yarn"):
            raise ValueError(
                f"rope_parameters.rope_type={rope['rope_type']!r}: the Qwen3-MoE bridge supports 'default' and 'yarn'"
            )
        if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError(
                f"rope_parameters.partial_rotary_factor={rope['partial_rotary_factor']}: the Qwen3-MoE bridge "
                "rotates whole heads; remove it (Qwen3 checkpoints do not set it)"
            )
        return yarn(self.hf)

    def megatron_config_class(self):
        if self.yarn is None:
            return super().megatron_config_class()
        # heavy: imports megatron-core at its top
        from parallel.bridges.yarn_config import YarnTransformerConfig

        return YarnTransformerConfig

    def transformer_config_kwargs(self) -> dict[str, Any]:
        if self.get("attention_bias", False):
            raise ValueError("Qwen3-MoE with attention_bias=true is not supported by this bridge")
        scaled = self.yarn
        return dict(
            **self.gqa_decoder_kwargs(),
            **({} if scaled is None else scaled.megatron_fields()),
            qk_layernorm=True,
            num_moe_experts=self.num_experts,
            moe_ffn_hidden_size=self.get("moe_intermediate_size"),
            moe_router_topk=self.get("num_experts_per_tok"),
            moe_layer_freq=self.moe_layer_pattern(),
            moe_router_score_function="softmax",
            # top-k then softmax over the k logits == softmax, top-k, renormalise
            moe_router_pre_softmax=not self.get("norm_topk_prob", False),
        )

    def layer_spec(self, config, use_te: bool, vp_stage: int | None = None):
        # heavy: megatron-core, loaded only where a model is built (after parallel.cpu_compat.apply)
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_decoder_block_spec,
        )

        return get_gpt_decoder_block_spec(
            config, use_transformer_engine=use_te, normalization="RMSNorm", qk_l2_norm=False, vp_stage=vp_stage
        )

    def gpt_model_kwargs(self, layout) -> dict[str, Any]:
        kwargs = super().gpt_model_kwargs(layout)
        if self.yarn is not None:
            kwargs["position_embedding_type"] = "yarn"
        return kwargs

    def mappings(self, te: bool = False) -> tuple:
        return (
            *self.common_mappings(te),
            *self.attention_mappings(qk_norm=True),
            *self.dense_mlp_mappings(),
            Replicated("decoder.layers.*.mlp.router.weight", "model.layers.*.mlp.gate.weight"),
            *self.expert_mappings("model.layers.*.mlp.experts.*", "gate_proj", "up_proj", "down_proj", te),
        )
