"""Mixtral: GQA attention (no q/k norm), RoPE, SwiGLU experts under `block_sparse_moe`
(w1 gate, w3 up, w2 down), softmax top-k router with the k weights renormalised, every layer MoE."""

from __future__ import annotations

from typing import Any

from parallel.bridges.base import Bridge, register
from parallel.mappings import Replicated


@register
class MixtralBridge(Bridge):
    architectures = ("MixtralForCausalLM",)

    @property
    def num_experts(self) -> int:
        return int(self.get("num_local_experts"))

    def transformer_config_kwargs(self) -> dict[str, Any]:
        if self.get("sliding_window", None) is not None:
            raise ValueError("Mixtral with sliding_window set is not supported by this bridge: set it to null")
        return dict(
            **self.gqa_decoder_kwargs(),
            num_moe_experts=self.num_experts,
            moe_ffn_hidden_size=self.get("intermediate_size"),
            moe_router_topk=self.get("num_experts_per_tok"),
            moe_router_score_function="softmax",
            moe_router_pre_softmax=False,  # softmax over the k logits == softmax, top-k, renormalise
        )

    def layer_spec(self, config, use_te: bool, vp_stage: int | None = None):
        # heavy: megatron-core, loaded only where a model is built (after parallel.cpu_compat.apply)
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        return get_gpt_decoder_block_spec(
            config, use_transformer_engine=use_te, normalization="RMSNorm", vp_stage=vp_stage
        )

    def mappings(self, te: bool = False) -> tuple:
        return (
            *self.common_mappings(te),
            *self.attention_mappings(qk_norm=False),
            Replicated("decoder.layers.*.mlp.router.weight", "model.layers.*.block_sparse_moe.gate.weight"),
            *self.expert_mappings("model.layers.*.block_sparse_moe.experts.*", "w1", "w3", "w2", te),
        )
