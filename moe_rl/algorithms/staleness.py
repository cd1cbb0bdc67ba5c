"""Per-token staleness: which response tokens were produced by weights too old to train on.

Every response token carries the weight version that produced it (`Sample.weight_versions`;
a resumed rollout mixes versions). The policy loss drops the tokens this mask marks when
`AlgorithmConfig.mask_stale_tokens` is set; the caller places the mask at the tokens'
positions in the batch, like the rollout logprobs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def stale_token_mask(
    weight_versions: Sequence[str | int], trainer_version: int, max_token_staleness: int
) -> torch.Tensor:
    """bool [n]: True where trainer_version - version > max_token_staleness.

    Versions are integers (the engines' `weight_version` strings are their decimal form).
    """
    if max_token_staleness < 0:
        raise ValueError(f"max_token_staleness={max_token_staleness}: must be >= 0")
    try:
        versions = torch.tensor([int(v) for v in weight_versions], dtype=torch.long)
    except ValueError:
        raise ValueError(
            f"weight_versions {list(weight_versions)[:4]}...: each must be an integer version "
            "(as the trainer publishes them)"
        ) from None
    if (versions > trainer_version).any():
        raise ValueError(
            f"weight_versions reach {int(versions.max())} but trainer_version={trainer_version}: "
            "a token cannot come from weights the trainer has not produced yet"
        )
    return (trainer_version - versions) > max_token_staleness
