"""Block-scaled FP8 weights, as DeepSeek-V3's checkpoints store them.

`config.json` says `quantization_config: {quant_method: fp8, fmt: e4m3, weight_block_size: [128,
128]}`; each quantized `X.weight` is float8_e4m3fn and `X.weight_scale_inv` (float32) holds one
factor per block of 128 x 128 (rows, cols) of its last two dims: weight = fp8 x scale_inv,
block by block. The grid is ceil(rows / 128) x ceil(cols / 128): the last block of a dim that
128 does not divide is cut short (DeepSeek-V3's kv_a_proj_with_mqa has 576 rows).

Round trip: FP8 -> dequantized fp32 -> `quantize` gives back the same bytes and scales (the
block's largest FP8 value is exactly 448 again). Through bf16 the FP8 bytes come back, and each
scale within 2^-9 of its original (bf16 keeps 8 significant bits of amax).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch

SCALE_SUFFIX = "_scale_inv"
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
FULL = (".gate.weight", ".embed_tokens.weight", ".shared_head.head.weight")
"""Decoder-layer weights that stay in full precision: routers and the MTP layers' embedding/head copies."""


@dataclass(frozen=True)
class BlockFP8:
    """The checkpoint's block size (rows, cols)."""

    rows: int
    cols: int

    @staticmethod
    def from_hf_config(config: dict[str, Any]) -> BlockFP8 | None:
        """None for an unquantized checkpoint; ValueError naming the field for a quantization this
        import cannot read."""
        quant = config.get("quantization_config")
        if not quant:
            return None
        method, fmt = quant.get("quant_method"), quant.get("fmt", "e4m3")
        if method != "fp8" or fmt != "e4m3":
            raise ValueError(
                f"quantization_config: quant_method={method!r} fmt={fmt!r} cannot be imported (only "
                "block-scaled fp8 e4m3, as DeepSeek-V3 ships): dequantize the checkpoint first"
            )
        block = quant.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise ValueError(f"quantization_config.weight_block_size={block!r}: expected [rows, cols], e.g. [128, 128]")
        return BlockFP8(*block)

    def hf_config(self) -> dict[str, Any]:
        """The `quantization_config` of a checkpoint written with these blocks (DeepSeek-V3's)."""
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [self.rows, self.cols],
        }

    def quantize_stream(self, items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """An HF (name, tensor) stream with every decoder linear weight as FP8 blocks plus its
        `*_scale_inv`, as DeepSeek's checkpoints hold them; norms, biases, routers (`*.gate.weight`),
        embeddings and the LM head (the MTP layers' copies of both included) stay as they are. One
        tensor at a time."""
        for name, tensor in items:
            if self.quantizes(name, tensor.ndim):
                quantized, scale_inv = self.quantize(tensor)
                yield name, quantized
                yield name + SCALE_SUFFIX, scale_inv
            else:
                yield name, tensor

    @staticmethod
    def quantizes(name: str, ndim: int) -> bool:
        """True for the HF tensors `quantize_stream` turns into FP8 blocks (decoder linear weights)."""
        return name.startswith("model.layers.") and name.endswith(".weight") and ndim == 2 and not name.endswith(FULL)

    def dequantize_named(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """{name: tensor} with each FP8 `X` and its `X_scale_inv` replaced by the float32 `X`; a
        scale whose weight is not there is a ValueError (they always travel together)."""
        out = {}
        for name, tensor in tensors.items():
            if name.endswith(SCALE_SUFFIX):
                if name.removesuffix(SCALE_SUFFIX) not in tensors:
                    raise ValueError(f"{name} came without its weight {name.removesuffix(SCALE_SUFFIX)}")
                continue
            scale = tensors.get(name + SCALE_SUFFIX)
            out[name] = tensor if scale is None else self.dequantize(tensor, scale)
        return out

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (*shape[:-2], math.ceil(shape[-2] / self.rows), math.ceil(shape[-1] / self.cols))

    def block_span(self, start: int, stop: int, dim: int) -> tuple[int, int]:
        """The scale rows (dim -2) or cols (dim -1) covering [start, stop) of the weight."""
        size = self.rows if dim == -2 else self.cols
        return start // size, math.ceil(stop / size)

    def dequantize(self, weight: torch.Tensor, scale_inv: torch.Tensor, row0: int = 0, col0: int = 0) -> torch.Tensor:
        """float32 `weight` x its block factors. `weight` is a region of the full tensor starting at
        (row0, col0) of its last two dims; `scale_inv` the scale blocks covering it, from block
        (row0 // rows, col0 // cols)."""
        r, c = row0 % self.rows, col0 % self.cols
        factors = scale_inv.float().repeat_interleave(self.rows, dim=-2).repeat_interleave(self.cols, dim=-1)
        factors = factors[..., r : r + weight.shape[-2], c : c + weight.shape[-1]]
        return weight.float() * factors

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(float8_e4m3fn weight, float32 scale_inv) the way DeepSeek's checkpoints are made:
        each block scaled so that its largest magnitude is 448 (an all-zero block keeps factor 1).
        Everything is allocated on `weight.device` (a GPU weight is quantized on its GPU, never
        copied to the host); peak extra memory about 3x the weight in fp32."""
        rows, cols = weight.shape[-2:]
        grid = self.scale_shape(tuple(weight.shape))
        padded = torch.zeros(
            *weight.shape[:-2], grid[-2] * self.rows, grid[-1] * self.cols, dtype=torch.float32, device=weight.device
        )
        padded[..., :rows, :cols] = weight.float()
        blocks = padded.unflatten(-1, (grid[-1], self.cols)).unflatten(-3, (grid[-2], self.rows))
        amax = blocks.abs().amax(dim=(-3, -1))
        # divided by a tensor, not the Python scalar: CUDA divides by a scalar as a product with its
        # reciprocal, 1 ulp off the CPU's quotient at times (seen on an H200), which moves ties
        scale_inv = torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))
        expanded = scale_inv.repeat_interleave(self.rows, dim=-2).repeat_interleave(self.cols, dim=-1)
        quantized = (padded / expanded)[..., :rows, :cols].to(torch.float8_e4m3fn)
        return quantized, scale_inv
