"""The trainer tests' names for the shared tiny Qwen3-MoE (tests/tiny_models.py: hidden 64, 4
experts, 4 layers, GQA)."""

from tests.tiny_models import QWEN3_MOE, hf_config

TINY_QWEN3_MOE = QWEN3_MOE

__all__ = ["TINY_QWEN3_MOE", "hf_config"]
