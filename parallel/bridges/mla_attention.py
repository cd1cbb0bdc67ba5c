"""Core attention for Multi-Latent Attention on megatron-core's local (non-TE) spec.

megatron-core 0.16.1's MLASelfAttention builds its core attention with
`k_channels=q_head_dim, v_channels=v_head_dim` (queries/keys are wider than values), but the
local spec's `DotProductAttention` accepts neither argument and assumes one head size
(`kv_channels`), so an MLA model cannot be built without Transformer Engine. This module is
the local spec's replacement: softmax(q k^T * softmax_scale + causal mask) v per head, with
different q/k and v head sizes. `softmax_scale` comes from MLASelfAttention (1/sqrt(q_head_dim),
times mscale^2 for YaRN), which is what transformers' DeepseekV3Attention uses.

It holds no parameters, so checkpoints and the bridge tables are unaffected. The TE spec keeps
TEDotProductAttention, which accepts both head sizes and packed (THD) sequences. This module, like
the rest of the local spec, runs [s, b] batches only and refuses packed ones: packing needs the TE
spec for every attention (the trainer refuses it on the local spec before building a model).
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor


class MLACoreAttention(MegatronModule):
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
        if config.context_parallel_size != 1:
            raise ValueError(
                "context_parallel_size > 1 with MLA needs Transformer Engine: set it to 1 on the local (CPU) spec"
            )
        self.attn_mask_type = attn_mask_type
        # Attention.__init__ first builds one with the config's head size only; MLASelfAttention
        # then replaces it with the MLA sizes and scale, which are the ones that run.
        self.k_channels = k_channels or config.kv_channels
        self.v_channels = v_channels or config.kv_channels
        self.softmax_scale = softmax_scale or self.k_channels**-0.5
        self.dropout = torch.nn.Dropout(config.attention_dropout if attention_dropout is None else attention_dropout)

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
                "packed sequences / attention bias with MLA need Transformer Engine's attention: use the TE spec"
            )
        mask_type = attn_mask_type or self.attn_mask_type
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, dim]
        scores = torch.matmul(q, k.transpose(-1, -2)).float() * self.softmax_scale
        masked = None
        if mask_type == AttnMaskType.causal:
            sq, sk = scores.shape[-2:]
            masked = torch.ones(sq, sk, dtype=torch.bool, device=scores.device).triu(sk - sq + 1)
        if attention_mask is not None:  # Megatron's convention: True = do not attend
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
