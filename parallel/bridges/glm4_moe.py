"""GLM-4.5 class (Glm4Moe): GQA with q/k/v bias and optional per-head q/k RMSNorm, partial
RoPE, the first `first_k_dense_replace` layers dense, then MoE layers with a shared expert and
a sigmoid router with expert-score correction bias, group-limited top-k, renormalised top-k
weights scaled by `routed_scaling_factor`."""

from __future__ import annotations

from typing import Any

from parallel.bridges.base import Bridge, register
from parallel.mappings import GatedColumn, Replicated, RowParallel


@register
class Glm4MoeBridge(Bridge):
    architectures = ("Glm4MoeForCausalLM",)
    has_expert_bias = True
    aux_loss_type = "seq_aux_loss"  # GLM-4.5 trained with a sequence-level balance loss beside the bias

    @property
    def num_experts(self) -> int:
        return int(self.get("n_routed_experts"))

    def moe_layer_pattern(self) -> list[int]:
        return [int(i >= self.get("first_k_dense_replace")) for i in range(self.get("num_hidden_layers"))]

    def transformer_config_kwargs(self) -> dict[str, Any]:
        return dict(
            **self.gqa_decoder_kwargs(),
            qk_layernorm=bool(self.get("use_qk_norm", False)),
            add_qkv_bias=bool(self.get("attention_bias", False)),
            moe_layer_freq=self.moe_layer_pattern(),
            **sigmoid_router_kwargs(self),
        )

    def gpt_model_kwargs(self, layout) -> dict[str, Any]:
        rope = self.get("rope_parameters", None) or {}
        partial = rope.get("partial_rotary_factor", self.get("partial_rotary_factor", 1.0))
        return dict(super().gpt_model_kwargs(layout), rotary_percent=float(partial))

    def layer_spec(self, config, use_te: bool, vp_stage: int | None = None):
        # heavy: megatron-core, loaded only where a model is built (after parallel.cpu_compat.apply)
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        return get_gpt_decoder_block_spec(
            config, use_transformer_engine=use_te, normalization="RMSNorm", vp_stage=vp_stage
        )

    def mappings(self, te: bool = False) -> tuple:
        qk_norm, bias = bool(self.get("use_qk_norm", False)), bool(self.get("attention_bias", False))
        return self.with_mtp(
            (
                *self.common_mappings(te),
                *self.attention_mappings(qk_norm=qk_norm, qkv_bias=bias),
                *self.dense_mlp_mappings(),
                *routed_and_shared_expert_mappings(self, te),
            )
        )


def sigmoid_router_kwargs(bridge: Bridge) -> dict[str, Any]:
    """DeepSeek-V3 / GLM-4.5 routing in Megatron's terms (shared by both bridges)."""
    experts, top_k = bridge.num_experts, int(bridge.get("num_experts_per_tok"))
    groups, group_topk = int(bridge.get("n_group", 1) or 1), int(bridge.get("topk_group", 1) or 1)
    if not bridge.get("norm_topk_prob", True) and top_k > 1:
        raise ValueError(
            "norm_topk_prob=false with a sigmoid router: Megatron always renormalises the "
            "top-k weights; this bridge needs norm_topk_prob=true"
        )
    if groups > 1 and top_k // group_topk != 2:
        raise ValueError(
            f"n_group={groups}: HF scores a group by its top-2 experts, Megatron by its top "
            f"num_experts_per_tok/topk_group={top_k}/{group_topk}; make that ratio 2"
        )
    return dict(
        num_moe_experts=experts,
        moe_ffn_hidden_size=bridge.get("moe_intermediate_size"),
        moe_router_topk=top_k,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,  # HF's correction bias; its update: parallel.router
        moe_router_num_groups=groups if groups > 1 else None,
        moe_router_group_topk=group_topk if groups > 1 else None,
        moe_router_topk_scaling_factor=float(bridge.get("routed_scaling_factor", 1.0)),
        moe_shared_expert_intermediate_size=int(bridge.get("n_shared_experts")) * bridge.get("moe_intermediate_size"),
        moe_shared_expert_overlap=False,
    )


def routed_and_shared_expert_mappings(bridge: Bridge, te: bool = False) -> tuple:
    """HF `mlp.gate` (+ correction bias), `mlp.experts.{e}`, `mlp.shared_experts` (DeepSeek-V3 / GLM-4.5)."""
    shared = "model.layers.*.mlp.shared_experts"
    return (
        Replicated("decoder.layers.*.mlp.router.weight", "model.layers.*.mlp.gate.weight"),
        Replicated("decoder.layers.*.mlp.router.expert_bias", "model.layers.*.mlp.gate.e_score_correction_bias"),
        *bridge.expert_mappings("model.layers.*.mlp.experts.*", "gate_proj", "up_proj", "down_proj", te),
        GatedColumn(
            "decoder.layers.*.mlp.shared_experts.linear_fc1.weight",
            f"{shared}.gate_proj.weight",
            f"{shared}.up_proj.weight",
        ),
        RowParallel("decoder.layers.*.mlp.shared_experts.linear_fc2.weight", f"{shared}.down_proj.weight"),
    )
