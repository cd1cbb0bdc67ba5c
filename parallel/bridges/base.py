"""What every architecture bridge provides, and the registry that picks one for an HF config.

A bridge turns an HF config into Megatron's TransformerConfig + layer spec + GPTModel
arguments. Architectures are chosen by the HF `architectures` field (never by substring).
"""

from __future__ import annotations

import copy
import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from parallel.bridges.rope import rope_parameters
from parallel.layout import ModelShape, ParallelLayout
from parallel.mappings import QKV, ColumnParallel, GatedColumn, Replicated, RowParallel, SharedWithMTP, VocabParallel
from parallel.router import RouterTraining

VOCAB_DIVISOR = 128
"""Vocab is padded to a multiple of lcm(128, tp): the same padding for tp in {1,2,4,8}, so a
checkpoint saved under one layout loads under another (Megatron pads per TP size)."""

_REGISTRY: dict[str, type["Bridge"]] = {}


def register(cls: type["Bridge"]) -> type["Bridge"]:
    for name in cls.architectures:
        _REGISTRY[name] = cls
    return cls


def registered_architectures() -> list[str]:
    return sorted(_REGISTRY)


def bridge_for(hf_config: Any) -> "Bridge":
    """The bridge for an HF config (transformers PretrainedConfig or its dict)."""
    archs = _get(hf_config, "architectures", None) or []
    for arch in archs:
        if arch in _REGISTRY:
            return _REGISTRY[arch](hf_config)
    raise ValueError(
        f"no bridge for architectures={archs} (model_type={_get(hf_config, 'model_type', None)!r}); "
        f"supported: {registered_architectures()}"
    )


def without_mtp(hf_config: Any) -> Any:
    """`hf_config` (a dict or a transformers config, not changed) with its multi-token-prediction
    layers dropped: num_nextn_predict_layers 0. Import then skips their tensors (with a warning,
    `HFCheckpointReader.mtp_names`), and every export and weight sync describes, and
    carries, a model without them."""
    if isinstance(hf_config, dict):
        return {**hf_config, "num_nextn_predict_layers": 0}
    dropped = copy.deepcopy(hf_config)
    dropped.num_nextn_predict_layers = 0
    return dropped


def _get(cfg: Any, key: str, default: Any = ...) -> Any:
    value = cfg.get(key, default) if isinstance(cfg, dict) else getattr(cfg, key, default)
    if value is ...:
        raise ValueError(f"HF config lacks the field {key!r}")
    return value


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    divisor = math.lcm(VOCAB_DIVISOR, tp)
    return -(-vocab_size // divisor) * divisor


class Bridge:
    """Base class: HF config field access and the Megatron config shared by MoE decoders."""

    architectures: ClassVar[tuple[str, ...]] = ()
    has_expert_bias: ClassVar[bool] = False
    """The routers add a per-expert score bias (HF `mlp.gate.e_score_correction_bias`)."""
    aux_loss_type: ClassVar[str] = "aux_loss"
    """megatron-core's load-balancing loss for this architecture, used when the coefficient is > 0."""

    def __init__(self, hf_config: Any):
        self.hf = hf_config

    def get(self, key: str, default: Any = ...) -> Any:
        return _get(self.hf, key, default)

    # -- what subclasses describe ------------------------------------------------------------
    @property
    def num_experts(self) -> int:
        """Routed experts per MoE layer (the HF field's name differs per architecture)."""
        raise NotImplementedError

    @property
    def num_query_groups(self) -> int:
        return int(self.get("num_key_value_heads"))

    def model_shape(self) -> ModelShape:
        return ModelShape(
            num_layers=self.get("num_hidden_layers"),
            num_attention_heads=self.get("num_attention_heads"),
            num_query_groups=self.num_query_groups,
            num_experts=self.num_experts,
            vocab_size=self.vocab_size,
        )

    def moe_layer_pattern(self) -> list[int]:
        """Per decoder layer, 1 for an MoE layer and 0 for a dense one (megatron's moe_layer_freq)."""
        return [1] * int(self.get("num_hidden_layers"))

    @property
    def moe_layers(self) -> list[int]:
        """HF indices of the MoE layers (the rows of routing data that name experts)."""
        return [layer for layer, moe in enumerate(self.moe_layer_pattern()) if moe]

    def transformer_config_kwargs(self) -> dict[str, Any]:
        """Architecture-specific TransformerConfig fields."""
        raise NotImplementedError

    def layer_spec(self, config, use_te: bool, vp_stage: int | None = None):
        raise NotImplementedError

    def mappings(self, te: bool = False) -> tuple:
        """The declarative table: every Megatron parameter <-> HF names, for the local spec
        or (`te=True`) the Transformer Engine spec, whose fused modules rename the norms
        (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`) and whose grouped
        experts (TEGroupedMLP) hold `experts.linear_fc1.weight{j}` for local expert j."""
        raise NotImplementedError

    def megatron_config_class(self):
        # heavy: megatron-core, loaded only where a model is built (after parallel.cpu_compat.apply)
        from megatron.core.transformer import TransformerConfig

        return TransformerConfig

    # -- multi-token prediction (DeepSeek-V3, GLM-4.5) -----------------------------------------
    @property
    def mtp_layers(self) -> int:
        """MTP layers of the model (`num_nextn_predict_layers`; 0 once `without_mtp`)."""
        return int(self.get("num_nextn_predict_layers", 0) or 0)

    def mtp_block_spec(self, config, use_te: bool):
        """megatron-core's MTP block spec for this stage (None where it holds no MTP layer: all of
        them live on the last pipeline stage). Its transformer layer is the decoder's last layer."""
        if not self.mtp_layers:
            return None
        # heavy: megatron-core, loaded only where a model is built (after parallel.cpu_compat.apply)
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        return get_gpt_mtp_block_spec(config, self.layer_spec(config, use_te=use_te), use_transformer_engine=use_te)

    def with_mtp(self, decoder_table: tuple) -> tuple:
        """`decoder_table` plus the MTP block's mappings when the model has MTP layers: HF layer
        `num_hidden_layers + k` holds `enorm`, `hnorm`, `eh_proj` (column-parallel, like Megatron's),
        `shared_head.norm` (Megatron's `final_layernorm`) and a decoder layer (mapped as the
        decoder's, `Mapping.for_mtp`); its `embed_tokens` / `shared_head.head` are the model's own
        (`SharedWithMTP` in `common_mappings`)."""
        if not self.mtp_layers:
            return decoder_table
        first = int(self.get("num_hidden_layers"))
        layer = [m.for_mtp(first) for m in decoder_table if m.megatron.startswith("decoder.layers.*.")]
        hf = "model.layers.*"
        return (
            *decoder_table,
            *layer,
            Replicated("mtp.layers.*.enorm.weight", f"{hf}.enorm.weight", layer_base=first),
            Replicated("mtp.layers.*.hnorm.weight", f"{hf}.hnorm.weight", layer_base=first),
            ColumnParallel("mtp.layers.*.eh_proj.weight", f"{hf}.eh_proj.weight", layer_base=first),
            Replicated("mtp.layers.*.final_layernorm.weight", f"{hf}.shared_head.norm.weight", layer_base=first),
        )

    # -- tables shared by the decoder families --------------------------------------------
    def common_mappings(self, te: bool = False) -> tuple:
        """Embedding, final norm, output layer and the attention-block norms (HF Llama naming).
        TE: GQA layers fuse the input norm into `linear_qkv` and dense layers the pre-MLP norm
        into `linear_fc1` (MoE layers and MLA keep separate norm modules)."""
        te_norms = (
            (
                Replicated(
                    "decoder.layers.*.self_attention.linear_qkv.layer_norm_weight",
                    "model.layers.*.input_layernorm.weight",
                ),
                Replicated(
                    "decoder.layers.*.mlp.linear_fc1.layer_norm_weight",
                    "model.layers.*.post_attention_layernorm.weight",
                ),
            )
            if te
            else ()
        )
        embedding, output = "embedding.word_embeddings.weight", "output_layer.weight"
        mtp = [f"model.layers.{int(self.get('num_hidden_layers')) + k}" for k in range(self.mtp_layers)]
        if mtp and self.tie_word_embeddings:
            raise ValueError("MTP layers with tie_word_embeddings=true: no bridge maps them; set model.mtp: drop")
        if mtp:
            io = (
                SharedWithMTP(
                    embedding, "model.embed_tokens.weight", *(f"{m}.embed_tokens.weight" for m in mtp), main_stage=0
                ),
                SharedWithMTP(output, "lm_head.weight", *(f"{m}.shared_head.head.weight" for m in mtp), main_stage=-1),
            )
        elif self.tie_word_embeddings:  # the last stage's copy loads from the embedding, never exported
            io = (
                VocabParallel(embedding, "model.embed_tokens.weight"),
                VocabParallel(output, "model.embed_tokens.weight", export=False),
            )
        else:
            io = (VocabParallel(embedding, "model.embed_tokens.weight"), VocabParallel(output, "lm_head.weight"))
        return (
            *te_norms,
            *io,
            Replicated("decoder.final_layernorm.weight", "model.norm.weight"),
            Replicated("decoder.layers.*.input_layernorm.weight", "model.layers.*.input_layernorm.weight"),
            Replicated("decoder.layers.*.pre_mlp_layernorm.weight", "model.layers.*.post_attention_layernorm.weight"),
        )

    @property
    def head_dim(self) -> int:
        return int(self.get("head_dim", None) or self.get("hidden_size") // self.get("num_attention_heads"))

    def attention_mappings(self, *, qk_norm: bool, qkv_bias: bool = False) -> tuple:
        """GQA attention (HF q/k/v/o_proj, optional per-head q/k RMSNorm and q/k/v bias)."""
        attn = "model.layers.*.self_attn"
        qkv = "decoder.layers.*.self_attention.linear_qkv"
        groups = dict(num_query_groups=self.get("num_key_value_heads"), head_dim=self.head_dim)
        table = [
            QKV(f"{qkv}.weight", f"{attn}.q_proj.weight", f"{attn}.k_proj.weight", f"{attn}.v_proj.weight", **groups),
            RowParallel("decoder.layers.*.self_attention.linear_proj.weight", f"{attn}.o_proj.weight"),
        ]
        if qkv_bias:
            table.append(
                QKV(f"{qkv}.bias", f"{attn}.q_proj.bias", f"{attn}.k_proj.bias", f"{attn}.v_proj.bias", **groups)
            )
        if qk_norm:
            table += [
                Replicated("decoder.layers.*.self_attention.q_layernorm.weight", f"{attn}.q_norm.weight"),
                Replicated("decoder.layers.*.self_attention.k_layernorm.weight", f"{attn}.k_norm.weight"),
            ]
        return tuple(table)

    def expert_mappings(self, experts: str, gate: str, up: str, down: str, te: bool = False) -> tuple:
        """Routed experts (HF `{experts}.{e}.{gate|up|down}.weight`, `experts` with `*` for layer
        and expert): SequentialMLP's `local_experts.{j}` (local spec, and TE without grouped GEMM),
        plus TEGroupedMLP's `linear_fc1.weight{j}` / `linear_fc2.weight{j}` on the TE spec (same
        per-expert layout, [gate_r; up_r] per ETP rank)."""
        layouts = ["decoder.layers.*.mlp.experts.local_experts.*.linear_fc{}.weight"]
        if te:
            layouts.append("decoder.layers.*.mlp.experts.linear_fc{}.weight*")
        table = []
        for megatron in layouts:
            table += [
                GatedColumn(megatron.format(1), f"{experts}.{gate}.weight", f"{experts}.{up}.weight", expert=True),
                RowParallel(megatron.format(2), f"{experts}.{down}.weight", expert=True),
            ]
        return tuple(table)

    def dense_mlp_mappings(self, hf_mlp: str = "mlp") -> tuple:

        return (
            GatedColumn(
                "decoder.layers.*.mlp.linear_fc1.weight",
                f"model.layers.*.{hf_mlp}.gate_proj.weight",
                f"model.layers.*.{hf_mlp}.up_proj.weight",
            ),
            RowParallel("decoder.layers.*.mlp.linear_fc2.weight", f"model.layers.*.{hf_mlp}.down_proj.weight"),
        )

    # -- shared ------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.get("vocab_size")

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(self.get("tie_word_embeddings", False))

    @property
    def rope_theta(self) -> float:
        return float(rope_parameters(self.hf)["rope_theta"])

    def gqa_decoder_kwargs(self) -> dict[str, Any]:
        """TransformerConfig fields of a GQA decoder with RMSNorm (all but MLA models)."""
        return dict(
            num_layers=self.get("num_hidden_layers"),
            hidden_size=self.get("hidden_size"),
            num_attention_heads=self.get("num_attention_heads"),
            num_query_groups=self.get("num_key_value_heads"),
            kv_channels=self.head_dim,
            ffn_hidden_size=self.get("intermediate_size"),
            normalization="RMSNorm",
            layernorm_epsilon=float(self.get("rms_norm_eps")),
        )

    def transformer_config(self, layout: ParallelLayout, router: RouterTraining | None = None, **overrides: Any):
        """Megatron TransformerConfig for this model under `layout` (fp32 unless overridden), its
        routers' load-balancing loss and expert-bias update as `router` says (default: neither)."""
        # heavy: megatron-core, loaded only where a model is built (after parallel.cpu_compat.apply)
        from megatron.core.utils import init_method_normal

        layout.check_model(self.model_shape())
        std = float(self.get("initializer_range", 0.02))
        kwargs: dict[str, Any] = dict(
            tensor_model_parallel_size=layout.tp,
            pipeline_model_parallel_size=layout.pp,
            context_parallel_size=layout.cp,
            cp_comm_type=layout.cp_comm_type,
            expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=layout.expert_tp,
            sequence_parallel=layout.sequence_parallel,
            params_dtype=torch.float32,
            pipeline_dtype=torch.float32,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            add_bias_linear=False,
            gated_linear_unit=True,
            activation_func=F.silu,
            bias_activation_fusion=False,
            masked_softmax_fusion=False,
            persist_layer_norm=False,
            bias_dropout_fusion=False,
            apply_rope_fusion=False,
            gradient_accumulation_fusion=False,
            use_cpu_initialization=True,  # layout-independent init, and CPU-only machines
            init_method_std=std,
            # as transformers draws it: megatron-core would scale attention out / MLP down by 1/sqrt(2L)
            output_layer_init_method=init_method_normal(std),
            moe_token_dispatcher_type="alltoall",
            moe_grouped_gemm=False,
            moe_router_dtype="fp32",
            moe_router_fusion=False,  # R3 replay is skipped silently under router fusion
            moe_permute_fusion=False,
        )
        kwargs.update(self.transformer_config_kwargs())
        kwargs.update((router or RouterTraining()).config_kwargs(self.has_expert_bias, self.aux_loss_type))
        if self.mtp_layers:
            kwargs["mtp_num_layers"] = self.mtp_layers
        kwargs.update(overrides)
        return self.megatron_config_class()(**kwargs)

    def padded_vocab_size(self, tp: int) -> int:
        return padded_vocab_size(self.vocab_size, tp)

    def gpt_model_kwargs(self, layout: ParallelLayout) -> dict[str, Any]:
        return dict(
            vocab_size=padded_vocab_size(self.vocab_size, layout.tp),
            max_sequence_length=int(self.get("max_position_embeddings", 4096)),
            position_embedding_type="rope",
            rotary_base=self.rope_theta,
            share_embeddings_and_output_weights=self.tie_word_embeddings,
        )
