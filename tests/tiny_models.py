"""The tiny random models the tests share: one definition of each, as HF config.json fields.

`QWEN3_MOE` (hidden 64, 4 experts, 4 layers, GQA) is the default; `QWEN3_MOE_SMALL` (hidden 32,
2 layers) is what the end-to-end runs (trainer ranks + engine, Ray) train. A test that needs
other shapes passes them as overrides, so what differs from the shared model is spelled out where
it is used. `MIXTRAL`, `GLM4_MOE` and `DEEPSEEK_V3` are the bridges' tiny models of those families.

Fields (a dict with `model_type`: a run config's `model.hf_config`, a config.json), keyword
arguments (no `model_type`: `Qwen3MoeConfig(**kwargs)`) and the transformers config are three
views of the same definition; `save_random_model` writes a seeded random-init checkpoint.
GLM-4.5 and DeepSeek-V3 carry no MTP layer here (transformers' configs default to one); the MTP
tests add it to a saved checkpoint with `with_mtp_layer`.
"""

from __future__ import annotations

from pathlib import Path

QWEN3_MOE = dict(
    model_type="qwen3_moe",
    architectures=["Qwen3MoeForCausalLM"],
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=True,
)

QWEN3_MOE_SMALL = {
    **QWEN3_MOE,
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 2,
    "head_dim": 8,
}

MIXTRAL = dict(
    model_type="mixtral",
    architectures=["MixtralForCausalLM"],
    vocab_size=256,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=4,
    num_experts_per_tok=2,
)

GLM4_MOE = dict(
    model_type="glm4_moe",
    architectures=["Glm4MoeForCausalLM"],
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
    num_nextn_predict_layers=0,
)

DEEPSEEK_V3 = dict(
    model_type="deepseek_v3",
    architectures=["DeepseekV3ForCausalLM"],
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=24,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    max_position_embeddings=256,
    num_nextn_predict_layers=0,
)


def hf_fields(base: dict = QWEN3_MOE, **overrides) -> dict:
    """The config.json fields of `base` with `overrides`, `model_type` included."""
    return {**base, **overrides}


def config_kwargs(base: dict = QWEN3_MOE, **overrides) -> dict:
    """The same fields as keyword arguments of the model type's config class (no `model_type`)."""
    fields = hf_fields(base, **overrides)
    fields.pop("model_type")
    return fields


def hf_config(base: dict = QWEN3_MOE, **overrides):
    """The transformers config (e.g. a `Qwen3MoeConfig`) of `base` with `overrides`."""
    from transformers import AutoConfig

    return AutoConfig.for_model(base["model_type"], **config_kwargs(base, **overrides))


def save_random_model(config, path: Path, seed: int = 0, dtype=None) -> Path:
    """A random-init model of `config` (its `architectures[0]` class, from `torch.manual_seed(seed)`),
    cast to `dtype` if given (float32 otherwise), saved with `save_pretrained` into `path`."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, config.architectures[0])(config)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(path)
    return path


def with_mtp_layer(tensors: dict, config: dict) -> dict:
    """`tensors` plus MTP layer `model.layers.{num_hidden_layers}` as DeepSeek ships it: its own
    attention and MoE (here a copy of the last layer's), random enorm / hnorm / eh_proj /
    shared_head.norm, and copies of the model's embedding and head."""
    import torch

    last, mtp = config["num_hidden_layers"] - 1, config["num_hidden_layers"]
    hidden = config["hidden_size"]
    g = torch.Generator().manual_seed(3)
    layer = {
        n.replace(f"layers.{last}.", f"layers.{mtp}."): t.clone()
        for n, t in tensors.items()
        if n.startswith(f"model.layers.{last}.")
    }
    layer.update(
        {
            f"model.layers.{mtp}.{n}": t
            for n, t in {
                "enorm.weight": torch.rand(hidden, generator=g) + 0.5,
                "hnorm.weight": torch.rand(hidden, generator=g) + 0.5,
                "eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=g) * 0.02,
                "shared_head.norm.weight": torch.rand(hidden, generator=g) + 0.5,
                # DeepSeek stores copies of the model's embedding and head in every MTP layer
                "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
                "shared_head.head.weight": tensors["lm_head.weight"].clone(),
            }.items()
        }
    )
    return {**tensors, **layer}


def megatron_refusal(config) -> str | None:
    """Why the bridge refuses HF `config` under the installed megatron-core (e.g. DeepSeek-V3
    without q LoRA on 0.19), or None when it builds. Tests of such a combination skip with it."""
    from parallel.bridges import bridge_for
    from parallel.layout import ParallelLayout

    try:
        bridge_for(config).transformer_config(ParallelLayout(world_size=1))
    except ValueError as error:
        return str(error)
    return None
