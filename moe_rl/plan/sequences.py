"""Long sequences in `moe-rl plan` (modelled): what CP leaves each rank, whether the model's positions
cover them, and whether an engine's KV cache holds one.

SGLang keeps, per GPU and per token, every layer's keys and values for the requests of its
attention group (`engines.tp / engines.attn_dp` GPUs with DP attention, all `engines.tp` without):
  GQA   2 x ceil(num_key_value_heads / attention TP) x head_dim   (a head is replicated when the
                                                                    group has more GPUs than heads)
  MLA   kv_lora_rank + qk_rope_head_dim                            (the compressed latent, on every
                                                                    GPU of the group)
per layer, at KV_BYTES a value (SGLang's default KV cache dtype follows the model's bf16
activations), or at `engines.sglang.kv_cache_dtype`'s bytes (`sglang_options.KV_CACHE_BYTES`: 1 for
FP8, 0.5625 for FP4 with its block scales). A sequence must fit the KV cache left on a GPU
(`engine_memory`'s kv_cache) whole: SGLang caps a request at the tokens its cache can hold.
"""

from __future__ import annotations

from moe_rl.config import RunConfig
from moe_rl.engine.sglang_options import kv_cache_bytes, option_value
from parallel.bridges.rope import max_positions

GB = 1e9
KV_BYTES = 2
"""Bytes of a cached key or value (bf16)."""


def kv_bytes_per_token(hf, tp: int, attn_dp: int, value_bytes: float = KV_BYTES) -> float:
    """KV cache bytes one token takes on each GPU of its attention group (`value_bytes` a cached value)."""
    text = hf.get_text_config()
    if getattr(text, "kv_lora_rank", None) is not None:  # MLA
        per_layer = text.kv_lora_rank + text.qk_rope_head_dim
    else:
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        per_layer = 2 * -(-text.num_key_value_heads // (tp // attn_dp)) * head_dim
    return text.num_hidden_layers * per_layer * value_bytes


def longest_sequence(config: RunConfig) -> int:
    """The longest sequence an engine holds: data.seq_length or rollout.max_new_tokens (tokens)."""
    return max(config.data.seq_length, config.rollout.max_new_tokens if config.is_rl else 0)


def check_kv_cache(config: RunConfig, hf, kv_cache_gb: float) -> str:
    """A note on how many of the longest sequences an attention group's KV cache holds (`kv_cache_gb`
    left per GPU); ValueError when not one does."""
    e, tokens = config.engines, longest_sequence(config)
    value_bytes = kv_cache_bytes(e.sglang, KV_BYTES)
    per_sequence = kv_bytes_per_token(hf, e.tp, e.attn_dp, value_bytes) * tokens / GB
    if e.speculative is not None:  # the NEXTN draft keeps one more layer's KV for every token
        per_sequence *= 1 + 1 / hf.get_text_config().num_hidden_layers
    held = kv_cache_gb / per_sequence
    if held < 1:
        raise ValueError(
            f"engines: one {tokens}-token sequence needs {per_sequence:.1f} GB of KV cache on each GPU of its "
            f"attention group (attention TP = engines.tp/engines.attn_dp = {e.tp // e.attn_dp}), more than the "
            f"{kv_cache_gb:.1f} GB left: lower engines.attn_dp (attention over more GPUs), raise engines.tp, "
            "or shorten the sequences (data.seq_length, rollout.max_new_tokens)"
        )
    dtype = option_value(e.sglang, "kv_cache_dtype", "auto")
    return (
        f"engines: an attention group's KV cache (attention TP {e.tp // e.attn_dp}, kv_cache_dtype {dtype}: "
        f"{value_bytes:g} B a value) holds {held:.1f} sequences of {tokens} tokens ({per_sequence:.1f} GB each per GPU)"
    )


def sequence_notes(config: RunConfig, hf) -> list[str]:
    """What a micro-batch's sequence means per rank under CP, and sequences beyond the model's positions."""
    t, notes = config.trainer, []
    tokens = t.max_tokens_per_microbatch or config.data.seq_length * t.micro_batch_size
    if t.cp > 1:
        notes.append(
            f"trainer.cp={t.cp}: each CP rank holds {tokens // t.cp} of a micro-batch's {tokens} tokens "
            f"(2 x cp = {2 * t.cp} chunks); activations are sized per rank"
        )
    longest = longest_sequence(config)
    positions = max_positions(hf.get_text_config())
    if positions is not None and longest > positions:
        notes.append(
            f"sequences of {longest} tokens (data.seq_length, rollout.max_new_tokens) exceed the model's {positions} "
            "positions (max_position_embeddings, or YaRN's factor x original_max_position_embeddings): `moe-rl "
            "train` refuses them; give model.hf_config YaRN rope_parameters to cover them"
        )
    return notes
