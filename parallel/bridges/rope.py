"""RoPE scaling read from an HF config: the one parser the bridges and the context-length checks share.

An HF config names its RoPE parameters `rope_parameters` (transformers 5) or `rope_scaling`
(config.json files written before it, e.g. Qwen3's and DeepSeek-V3's as published), with the kind
under `rope_type` or `type`; the base is there or top-level `rope_theta`. `rope_parameters` reads
either, from a transformers config or its dict.

YaRN (Peng et al. 2023) is read as transformers computes it (`modeling_rope_utils._compute_yarn_parameters`):
`factor` (default max_position_embeddings / original_max_position_embeddings), `beta_fast` 32,
`beta_slow` 1, `truncate` (round the correction range) true, and the attention factor that multiplies
cos and sin: `attention_factor` where given, else mscale(factor, mscale) / mscale(factor, mscale_all_dim)
when both are set and non-zero, else mscale(factor) = 0.1 ln(factor) + 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    return cfg.get(key, default) if isinstance(cfg, dict) else getattr(cfg, key, default)


def rope_parameters(cfg: Any) -> dict[str, Any]:
    """The config's RoPE parameters with `rope_type` (default "default") and `rope_theta` filled in."""
    rope = dict(_get(cfg, "rope_parameters") or _get(cfg, "rope_scaling") or {})
    rope.setdefault("rope_type", rope.get("type", "default"))
    rope.setdefault("rope_theta", _get(cfg, "rope_theta", 10000.0))
    return rope


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's mscale (the paper's Eq. 21); 1 for factor <= 1, as in transformers and megatron-core."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True, kw_only=True)
class Yarn:
    """A config's YaRN parameters, defaults resolved as transformers resolves them."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    attention_factor: float  # multiplies cos and sin, so q.k by its square
    truncate: bool

    @property
    def scaled_positions(self) -> int:
        """Positions the scaled RoPE covers: factor x original_max_position_embeddings."""
        return int(self.factor * self.original_max_position_embeddings)

    def megatron_fields(self) -> dict[str, Any]:
        """`parallel.bridges.yarn_config.YarnTransformerConfig`'s fields, so that megatron-core's YaRN
        rotary embedding equals transformers': same factor, original positions, betas and rounding,
        and cos and sin multiplied by the same attention factor. Megatron's factor is
        0.1 x yarn_mscale x ln(factor) + 1 when yarn_mscale_all_dim is 0, and it has no field for
        transformers' `attention_factor`, so yarn_mscale is solved from it."""
        return dict(
            yarn_rotary_scaling_factor=self.factor,
            yarn_original_max_position_embeddings=self.original_max_position_embeddings,
            yarn_beta_fast=self.beta_fast,
            yarn_beta_slow=self.beta_slow,
            yarn_mscale=(self.attention_factor - 1.0) / (0.1 * math.log(self.factor)),
            yarn_mscale_all_dim=0.0,
            yarn_correction_range_round_to_int=self.truncate,
        )


def yarn(cfg: Any) -> Yarn | None:
    """The config's YaRN parameters, or None when its RoPE is not YaRN."""
    rope = rope_parameters(cfg)
    if rope["rope_type"] != "yarn":
        return None
    original = int(rope.get("original_max_position_embeddings") or _get(cfg, "max_position_embeddings"))
    factor = float(rope.get("factor") or _get(cfg, "max_position_embeddings") / original)
    if factor <= 1:
        raise ValueError(
            f"rope_parameters.factor={factor}: YaRN needs a factor > 1 (at 1 it is plain RoPE); "
            "raise it to the context wanted / original_max_position_embeddings, or remove the YaRN rope_parameters"
        )
    attention = rope.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention = yarn_mscale(factor)
    return Yarn(
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=float(rope.get("beta_fast") or 32),
        beta_slow=float(rope.get("beta_slow") or 1),
        attention_factor=float(attention),
        truncate=bool(rope.get("truncate", True)),
    )


def max_positions(cfg: Any) -> int | None:
    """The longest sequence the model's positions cover: max_position_embeddings, or with YaRN
    factor x original_max_position_embeddings where that is more (None: the config names neither)."""
    limit = _get(cfg, "max_position_embeddings")
    scaled = yarn(cfg)
    if scaled is None:
        return limit
    return max(limit or 0, scaled.scaled_positions)
