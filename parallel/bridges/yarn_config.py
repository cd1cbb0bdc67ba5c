"""megatron-core's TransformerConfig with the YaRN fields GPTModel reads for `position_embedding_type="yarn"`.

megatron-core 0.16.1 and 0.19.2 build GPTModel's `YarnRotaryEmbedding` from `config.yarn_*`
attributes that TransformerConfig does not declare (Megatron-LM's arguments and Megatron-Bridge's
model providers add them); the attention then multiplies cos and sin by
`_yarn_get_concentration_factor(yarn_rotary_scaling_factor, yarn_mscale, yarn_mscale_all_dim)`.
This dataclass declares them, so they survive `dataclasses.replace` and copies;
`parallel.bridges.rope.Yarn.megatron_fields` fills them from an HF config's YaRN.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.transformer import TransformerConfig


@dataclass
class YarnTransformerConfig(TransformerConfig):
    yarn_rotary_scaling_factor: float = 1.0
    """YaRN's factor: positions scale from original_max_position_embeddings to factor x that."""
    yarn_original_max_position_embeddings: int = 4096
    """Positions the model was pretrained on (the correction range is computed against them)."""
    yarn_beta_fast: float = 32.0
    """Rotations below which a dimension is interpolated fully."""
    yarn_beta_slow: float = 1.0
    """Rotations above which a dimension is extrapolated (kept as pretrained)."""
    yarn_mscale: float = 1.0
    """With yarn_mscale_all_dim 0: cos and sin are multiplied by 0.1 x yarn_mscale x ln(factor) + 1."""
    yarn_mscale_all_dim: float = 0.0
    """The denominator's mscale (0: a denominator of 1)."""
    yarn_correction_range_round_to_int: bool = True
    """Round the correction range to whole dimensions (transformers' `truncate`)."""
