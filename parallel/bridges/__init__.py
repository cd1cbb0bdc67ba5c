"""Megatron <-> HF bridges, one module per architecture, registered by HF architecture name."""

from parallel.bridges.base import Bridge, bridge_for, register, registered_architectures
from parallel.bridges import qwen3_moe  # noqa: F401  (registers itself)

__all__ = ["Bridge", "bridge_for", "register", "registered_architectures"]
