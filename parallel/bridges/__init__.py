"""Megatron <-> HF bridges, one module per architecture, registered by HF architecture name."""

from parallel.bridges import deepseek_v3, glm4_moe, mixtral, qwen3_moe  # noqa: F401  (register themselves)
from parallel.bridges.base import Bridge, bridge_for, register, registered_architectures, without_mtp

__all__ = ["Bridge", "bridge_for", "register", "registered_architectures", "without_mtp"]
