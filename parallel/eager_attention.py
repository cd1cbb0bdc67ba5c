"""Core attention for megatron-core's local (non-TE) spec where its own cannot run: Multi-Latent
Attention's head sizes, and context parallelism.

megatron-core's local `DotProductAttention` assumes one head size (`kv_channels`) and asserts
`context_parallel_size == 1` ("only supported by TEDotProductAttention"). `EagerAttention` is the
local spec's replacement: softmax(q k^T * softmax_scale + causal mask) v per head, with
- different q/k and v head sizes (MLA: megatron-core's MLASelfAttention builds its core attention
  with `k_channels=q_head_dim, v_channels=v_head_dim`; `softmax_scale` comes from it: 1/sqrt(q_head_dim),
  times mscale^2 for YaRN, as transformers' DeepseekV3Attention has it);
- grouped query attention (query head i reads key/value group i // (heads / groups), as the local
  DotProductAttention repeats them);
- context parallelism (`config.context_parallel_size > 1`): this rank holds chunks r and 2cp-1-r of
  the sequence (`parallel.context_parallel`); it gathers keys and values over the CP group, as
  Transformer Engine's `all_gather` CP communication does, and computes its queries' causal
  attention at their global positions. The gather's backward sums the key/value gradients over the
  CP group. Memory: the whole sequence's keys and values on every CP rank, and scores
  [b, heads, s / cp, s] (eager attention; TE's ring or flash kernels avoid both on GPUs).

It holds no parameters, so checkpoints and the bridge tables are unaffected. Packed (THD) sequences
need the TE spec (the trainer refuses them on the local spec before building a model).
`use_eager_attention(spec)` puts it into every attention of a layer or block spec.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor

from parallel.context_parallel import ContextSplit


class EagerAttention(MegatronModule):
    """Eager attention over [s, b, heads, dim] inputs, returning [s, b, heads * v_dim]."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        softmax_scale: Optional[float] = None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
        attention_dropout: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        self.attn_mask_type = attn_mask_type
        # MLA: Attention.__init__ first builds one with the config's head size only; MLASelfAttention
        # then replaces it with the MLA sizes and scale, which are the ones that run.
        self.k_channels = k_channels or config.kv_channels
        self.v_channels = v_channels or config.kv_channels
        self.softmax_scale = softmax_scale or self.k_channels**-0.5
        self.dropout = torch.nn.Dropout(config.attention_dropout if attention_dropout is None else attention_dropout)
        cp = config.context_parallel_size
        self.cp_group = parallel_state.get_context_parallel_group() if cp > 1 else None

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params=None,
    ) -> Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError(
                "packed sequences / attention bias on the local spec: they need Transformer Engine's attention "
                "(the TE spec)"
            )
        mask_type = attn_mask_type or self.attn_mask_type
        # causal over positions: queries are the last ones of the keys' sequence (sq <= sk)
        k_positions = torch.arange(key.shape[0], device=query.device)
        q_positions = k_positions[key.shape[0] - query.shape[0] :]
        if self.cp_group is not None:  # keys and values of the whole sequence; queries stay local
            split = ContextSplit(self.cp_group, [query.shape[0] * self.config.context_parallel_size], query.device)
            key, value = (split.gather(t, dim=0, sum_grads=True) for t in (key, value))
            q_positions, k_positions = split.index, torch.arange(split.total, device=query.device)
        groups = query.shape[2] // key.shape[2]
        key, value = (t.repeat_interleave(groups, dim=2) if groups > 1 else t for t in (key, value))
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, dim]
        scores = torch.matmul(q, k.transpose(-1, -2)).float() * self.softmax_scale
        masked = None
        if mask_type == AttnMaskType.causal:  # True = do not attend (Megatron's convention)
            masked = k_positions[None, :] > q_positions[:, None]
        if attention_mask is not None:
            masked = attention_mask if masked is None else masked | attention_mask
        if masked is not None:
            scores = scores.masked_fill(masked, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        if self.training and self.dropout.p > 0:
            if self.config.sequence_parallel:
                probs = self.dropout(probs)
            else:  # heads differ per TP rank: draw from the model-parallel RNG, as Megatron does
                with tensor_parallel.get_cuda_rng_tracker().fork():
                    probs = self.dropout(probs)
        context = torch.matmul(probs, v)  # [b, heads, s, v_dim]
        return context.permute(2, 0, 1, 3).reshape(context.shape[2], context.shape[0], -1)


def use_eager_attention(spec) -> None:
    """Make every attention of `spec` (a ModuleSpec or a block spec, MTP blocks included) core-attend
    with `EagerAttention`, in place."""
    submodules = getattr(spec, "submodules", None)
    if hasattr(submodules, "core_attention"):
        submodules.core_attention = EagerAttention
    children = list(getattr(spec, "layer_specs", None) or [])
    if dataclasses.is_dataclass(submodules):
        children += [getattr(submodules, f.name) for f in dataclasses.fields(submodules)]
    for child in children:
        if isinstance(child, ModuleSpec) or hasattr(child, "layer_specs"):
            use_eager_attention(child)
