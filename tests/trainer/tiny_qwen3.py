"""A tiny Qwen3-MoE config shared by the trainer tests (hidden 64, 4 experts, 4 layers, GQA)."""

TINY_QWEN3_MOE = dict(
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


def hf_config():
    from transformers import AutoConfig

    fields = dict(TINY_QWEN3_MOE)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)
