"""The GPU tiers, by what they need, and whether this machine has it.

    gpu          a CUDA GPU, CUDA torch and megatron-core (tests/gpu/: the CUDA path of everything
                 moe-rl ships without SGLang)
    gpu_sglang   a CUDA GPU and SGLang (the SGLang server, CUDA-IPC into SGLang's own code)
    gpu_te       a CUDA GPU and Transformer Engine (TE layer names, LoRA on real TE, packed sequences)

`tests/conftest.py` skips a marked test whose tier is not ready, naming what is missing;
`scripts/gpu_check.sh` runs `python -m tests.gpu_tiers` to choose the tiers it runs and to report
the others as not run. Nothing here imports SGLang or Transformer Engine: presence is looked up.
"""

from __future__ import annotations

import importlib.util
import sys

import torch

TIERS = {"gpu": ("megatron.core",), "gpu_sglang": ("sglang",), "gpu_te": ("transformer_engine",)}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # the parent package is missing
        return False


def missing(tier: str) -> list[str]:
    """What `tier` needs and this machine lacks (empty: the tier can run)."""
    lacking = [] if torch.cuda.is_available() else ["a CUDA GPU (torch.cuda.is_available() is False)"]
    return lacking + [module for module in TIERS[tier] if not _installed(module)]


def main() -> int:
    """One line per tier, `<tier> ready` or `<tier> not-run <what is missing>`; exit 0."""
    for tier in TIERS:
        lacking = missing(tier)
        print(f"{tier} ready" if not lacking else f"{tier} not-run {'; '.join(lacking)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
