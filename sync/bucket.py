"""Buckets: many named tensors packed into one flat uint8 buffer, and back.

Layout = SGLang's `FlattenedTensorBucket` (`sglang/srt/weight_sync/tensor_bucket.py`): tensors
back to back in order, no padding, each tensor's bytes in C order; the receiver rebuilds them
from names, dtypes and shapes alone. SGLang refuses a tensor whose byte offset is not a multiple
of its itemsize, so the packer closes a bucket rather than misalign the next tensor.

Checksum: CRC-32 (zlib) of the bucket's bytes, as "crc32:%08x", only where a receiving engine
verifies it (the embedded engine; SGLang has no such field): computed for nothing else, so a sync
to SGLang engines runs no hash and copies no weight to host memory. A verified bucket is always
on the host already (the embedded engine joins gloo groups), where zlib runs ~3-4 GB/s on one
core, releases the GIL, and catches every single-byte and burst error up to 32 bits.

Memory (sender): `BucketPacker` owns `num_buffers` (default 2) buffers of `bucket_bytes` each,
allocated once and reused; a tensor larger than `bucket_bytes` becomes a bucket of its own that
is a byte view of the tensor itself (no copy). Peak extra memory = 2 buffers + nothing more
than the export already holds.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (SGLang's spelling, `getattr(torch, name)` inverts it)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtypes: {name!r} is not a torch dtype name (e.g. 'bfloat16', 'float32')")
    return dtype


def checksum(data: torch.Tensor) -> str:
    """CRC-32 of a flat uint8 host tensor's bytes ("crc32:%08x"). A device tensor is refused:
    hashing it would copy the weights to the host, which is the tax this check must not add."""
    if data.device.type != "cpu":
        raise ValueError(f"checksum of a {data.device} bucket: only host buckets (gloo groups) are verified")
    return f"crc32:{zlib.crc32(data.numpy()):08x}"


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # byte offset in the bucket's buffer

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * self.dtype.itemsize


@dataclass
class Bucket:
    """One flat buffer and what is in it. `data` is exactly `nbytes` long (a view on a buffer)."""

    index: int
    data: torch.Tensor  # uint8, 1-D
    metas: list[TensorMeta]
    checksum: str | None  # None unless the packer was asked for checksums

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def announcement(self) -> dict:
        """The fields of SGLang's /update_weights_from_distributed that describe this bucket."""
        return {
            "names": [m.name for m in self.metas],
            "dtypes": [dtype_name(m.dtype) for m in self.metas],
            "shapes": [list(m.shape) for m in self.metas],
        }


def layout(names: list[str], dtypes: list[str], shapes: list[list[int]]) -> list[TensorMeta]:
    """Rebuild a bucket's metadata from an announcement (receiver side); checks it first."""
    if not (len(names) == len(dtypes) == len(shapes)) or not names:
        raise ValueError(
            f"names/dtypes/shapes: need equal, non-zero lengths, got {len(names)}/{len(dtypes)}/{len(shapes)}"
        )
    metas, offset = [], 0
    for name, dtype_str, shape in zip(names, dtypes, shapes):
        dtype = dtype_from_name(dtype_str)
        if any(int(d) < 0 for d in shape):
            raise ValueError(f"shapes: {name} has a negative dimension {shape}")
        if offset % dtype.itemsize:
            raise ValueError(f"names: {name} would start at unaligned byte offset {offset}")
        meta = TensorMeta(name, dtype, tuple(int(d) for d in shape), offset)
        metas.append(meta)
        offset += meta.nbytes
    return metas


def unpack(data: torch.Tensor, metas: list[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    """Views of each tensor in a received buffer (no copy: they share `data`'s memory)."""
    total = sum(m.nbytes for m in metas)
    assert data.dtype == torch.uint8 and data.numel() == total, (data.numel(), total)
    return [(m.name, data[m.offset : m.offset + m.nbytes].view(m.dtype).view(m.shape)) for m in metas]


class BucketPacker:
    """Packs a stream of `(name, tensor)` into buckets of at most `bucket_bytes` bytes.

    `pack(named_tensors)` is a lazy generator. Bucket i lives in buffer i % num_buffers, which
    bucket i + num_buffers overwrites: be done with bucket i (e.g. sent it) before asking the
    generator for bucket i + num_buffers. With 2 buffers: send bucket k while packing k + 1.
    `checksums`: give each bucket its `checksum` (only when a receiver verifies them).
    """

    def __init__(
        self, bucket_bytes: int, device: torch.device | str = "cpu", num_buffers: int = 2, checksums: bool = False
    ):
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes: must be positive, got {bucket_bytes}")
        self.bucket_bytes, self.checksums = bucket_bytes, checksums
        self.device = torch.device(device)
        self.buffers = [torch.empty(bucket_bytes, dtype=torch.uint8, device=self.device) for _ in range(num_buffers)]

    @property
    def buffer_bytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def pack(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[Bucket]:
        """Yield the buckets of `named_tensors`, in order (with their checksums if asked for)."""
        index, metas, offset = 0, [], 0
        buffer = None
        for name, tensor in named_tensors:
            nbytes = tensor.numel() * tensor.element_size()
            if metas and (offset + nbytes > self.bucket_bytes or offset % tensor.element_size()):
                yield self._close(index, buffer, metas, offset)
                index, metas, offset = index + 1, [], 0
            if nbytes > self.bucket_bytes:  # its own bucket: a byte view, no copy
                data = _byte_view(tensor.to(self.device))
                meta = TensorMeta(name, tensor.dtype, tuple(tensor.shape), 0)
                yield Bucket(index, data, [meta], checksum(data) if self.checksums else None)
                index += 1
                continue
            if not metas:
                buffer = self.buffers[index % len(self.buffers)]
            buffer[offset : offset + nbytes].copy_(_byte_view(tensor))
            metas.append(TensorMeta(name, tensor.dtype, tuple(tensor.shape), offset))
            offset += nbytes
            del tensor  # copied: let the export free it before it gathers the next tensors
        if metas:
            yield self._close(index, buffer, metas, offset)

    def _close(self, index: int, buffer: torch.Tensor, metas: list[TensorMeta], offset: int) -> Bucket:
        data = buffer[:offset]
        return Bucket(index, data, metas, checksum(data) if self.checksums else None)


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().view(-1).view(torch.uint8)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
