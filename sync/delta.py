"""Delta sync's codec: each tensor travels as the elements that changed bitwise since the version
the engines hold, and both ends keep the bytes that the next delta applies on.

At RL learning rates most values of the served weights (bf16, FP8) keep their bits from one step
to the next, so a version can travel as the changed elements alone. This module owns the wire
format (`encode`, `apply`, `header`), the sender's memory of what it sent (`KeptCopy`) and an
engine's copy of what it received (`AppliedCopy`); it knows nothing of transports or buckets.

Contract:
1. Bitwise: elements are compared and carried as integers of their own size (1 byte: fp8, int8,
   uint8, bool; 2: bf16, fp16; 4: fp32; 8: fp64, int64). An element changed iff its bits differ,
   so NaN payloads and -0.0 travel exactly.
2. Overwrite, never XOR: a payload sets each changed element to its new bits, so applying it to
   the base or to its own result gives the same tensor (a retried update is harmless).
3. One payload per tensor: a flat uint8 tensor under the tensor's own name, so it packs into the
   flattened buckets (`sync.bucket`) like any tensor. A fixed little-endian header, then the body.
4. Header (`HEADER_NBYTES` = 64 bytes, then the shape as ndim int64): magic b"MRLD", format (u8,
   `FORMAT`), encoding (u8: 0 none, 1 gaps, 2 bitmap, 3 dense), hash kind (u8, `digest`: 1 CRC32,
   2 SUM64), element size (u8), dtype (u8, an index into `DTYPES`), ndim (u8), 6 zero bytes;
   numel, count of changed elements (numel when there is no base), gap tokens (u64 each);
   base_version, version (i64: the version it applies on and the one it produces); the hash of the
   target's bytes AFTER applying (u64).
5. Body (each section but the last zero-padded to a multiple of 8 bytes):
   - none (count 0, whatever encoding was asked): empty; the header still carries both versions
     and the hash, so the engine verifies its copy and learns the tensor is at `version`;
   - gaps: `tokens` u16 tokens, then the count changed values. A token t < 65535 skips t unchanged
     elements and marks the next one changed; t = 65535 (the escape) skips 65535 unchanged
     elements and marks none, so a gap g is g // 65535 escapes, then g % 65535;
   - bitmap: ceil(numel / 8) bytes, bit i (little-endian bit order) set iff element i changed,
     then the values;
   - dense: every element's bits (the whole new tensor).
   "auto" takes the smallest payload for the count (`payload_nbytes`; ties go to dense, then bitmap).
6. `apply` checks the header against the target (element size, numel) and the base version BEFORE
   writing anything, then hashes the whole target after writing. A mismatch then means the target
   holds neither version: only a full anchor repairs it.
7. Versions: a delta applies on exactly `base_version`. `KeptCopy` and `AppliedCopy` hold no version
   while a stream is under way, so an update that fails halfway, on either side, makes the next one
   a full anchor (the sender calls `KeptCopy.invalidate` when the engines did not commit).

Where the work happens. `encode` runs in torch on the device of its tensors (a trainer's GPU), so
the compare keeps up with PCIe: `KeptCopy` takes its host copy up for the compare (one pass over
PCIe and host memory), the payload stays on the device for the gathers and the broadcast, and only
the payload comes back to write the changed elements into the host copy. A host tensor hashes with
CRC-32 (zlib, ~4 GB/s on one core here), a device one with SUM64 (torch ops, no host round trip);
the receiver computes the kind its header names. `apply` decodes and writes where the payload and
its target live (torch ops; the embedded engine's copy on the host, SGLang's parameters on their
GPU: `moe_rl.engine.sglang_delta`). Memory: encode
holds a bool mask (1 byte per element), the changed positions (8 bytes each), the payload and, for
a device tensor, the kept copy brought up (one tensor at a time); apply holds the positions or the
unpacked bitmap (8 or 1 bytes per element) besides the payload.
"""

from __future__ import annotations

import math
import struct
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Container, Iterable, Iterator

import numpy as np
import torch

MAGIC, FORMAT = b"MRLD", 1
CRC32, SUM64 = 1, 2
"""The header's hash kinds (`digest`)."""
SUM64_CHUNK = 1 << 20
"""Elements SUM64 takes at a time (its int64 temporaries: 8 MB each)."""
_SUM64_STEP = (2 * 0x9E3779B97F4A7C15) % (1 << 64)  # even and below 2**63: weights i x step + 1 are odd
DELTA_ENCODINGS = ("auto", "gaps", "bitmap", "dense")
"""What `sync.delta.encoding` and `encode` take: "auto" picks per tensor (contract point 5)."""
DELTA_LOAD_FORMAT = "flattened_bucket_delta"
"""The load_format that announces a bucket of payloads over the broadcast route (an embedded-engine
extension: SGLang 0.5.23's distributed route has no custom loader; SGLang takes `SGLANG_LOADER`)."""
SGLANG_LOADER = "moe_rl.engine.sglang_delta.load_delta"
"""SGLang's custom weight loader of these payloads (its `--custom-weight-loader` and the
`load_format` of `/update_weights_from_tensor`, the one route that runs such a loader)."""
SGLANG_COMMIT = "moe_rl.delta.commit"
"""The name of the last tensor of a version sent to that loader (int64 [version]): every rank
checks that it holds that version whole."""
ENCODINGS = ("none", "gaps", "bitmap", "dense")
"""The header's encoding ids, in order."""
DTYPES = (
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)
"""The header's dtype ids, in order."""
ESCAPE = 0xFFFF
MAX_NDIM = 8
"""The most dims a payload's header names here (a header's length is HEADER_NBYTES + 8 x ndim)."""
_FIXED = struct.Struct("<4sBBBBBB6xQQQqqQ")
HEADER_NBYTES = _FIXED.size
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class DeltaError(ValueError):
    """A payload that does not apply: another base version, a header that does not match the target,
    a malformed body, or a hash mismatch after applying (the target is then known-bad)."""


@dataclass(frozen=True)
class DeltaHeader:
    """A payload's header (contract point 4)."""

    encoding: str
    element_size: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    count: int
    tokens: int
    base_version: int
    version: int
    hash_kind: int
    hash: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """The whole payload's length."""
        return payload_nbytes(self.encoding, self.shape, self.element_size, self.count, self.tokens)


def payload_nbytes(encoding: str, shape: tuple[int, ...], element_size: int, count: int, tokens: int) -> int:
    """Bytes of a payload (contract points 4-5); `tokens` = count + escapes, read by "gaps" only."""
    head, values = HEADER_NBYTES + 8 * len(shape), count * element_size
    if encoding == "none":
        return head
    if encoding == "gaps":
        return head + _pad8(2 * tokens) + values
    if encoding == "bitmap":
        return head + _pad8(math.ceil(math.prod(shape) / 8)) + values
    assert encoding == "dense", encoding
    return head + math.prod(shape) * element_size


def encode(
    new: torch.Tensor,
    old: torch.Tensor | None,
    base_version: int,
    version: int,
    encoding: str = "auto",
    hash_kind: int | None = None,
) -> torch.Tensor:
    """The payload (flat uint8, on `new`'s device) that turns `old`'s bits into `new`'s. `old` None:
    dense (every element counts as changed); else `old` must have `new`'s shape, dtype and device.
    `hash_kind`: CRC32 or SUM64 (`digest`); None takes CRC32 for a host tensor, SUM64 on a device."""
    if encoding not in DELTA_ENCODINGS:
        raise ValueError(f"encoding: {encoding!r} is not one of {DELTA_ENCODINGS}")
    new_bits = bits(new)
    mask, positions, count = None, None, new.numel()
    if old is not None:
        if old.shape != new.shape or old.dtype != new.dtype or old.device != new.device:
            raise ValueError(
                f"old: {old.dtype}{list(old.shape)} on {old.device} is not new's {new.dtype}{list(new.shape)} on "
                f"{new.device}; pass old=None (dense)"
            )
        mask = new_bits != bits(old)
        count = int(torch.count_nonzero(mask))
    sizes = dict(shape=tuple(new.shape), element_size=new.element_size(), count=count)
    chosen = "dense" if old is None else encoding
    if count == 0 and old is not None:
        chosen = "none"
    elif chosen == "auto":
        best = min(("dense", "bitmap"), key=lambda e: payload_nbytes(e, tokens=0, **sizes))
        if payload_nbytes("gaps", tokens=count, **sizes) < payload_nbytes(best, tokens=0, **sizes):
            positions = _changed(mask)  # only when gaps may win: 8 bytes per changed element
            escapes = int((_gaps(positions) // ESCAPE).sum())
            best = min((best, "gaps"), key=lambda e: payload_nbytes(e, tokens=count + escapes, **sizes))
        chosen = best
    sections, tokens = [], 0
    if chosen == "gaps":  # u16 tokens: int32 -> int16 keeps each token's low 16 bits
        gap_tokens = _gap_tokens(_changed(mask) if positions is None else positions)
        tokens = gap_tokens.numel()
        sections.append(_padded(gap_tokens.to(torch.int16).view(torch.uint8)))
    elif chosen == "bitmap":
        sections.append(_padded(_packbits(mask)))
    if chosen != "none":
        sections.append((new_bits if chosen == "dense" else new_bits[mask]).view(torch.uint8))
    kind = hash_kind or (CRC32 if new.device.type == "cpu" else SUM64)
    head = _FIXED.pack(
        MAGIC,
        FORMAT,
        ENCODINGS.index(chosen),
        kind,
        new.element_size(),
        _dtype_id(new.dtype),
        new.dim(),
        new.numel(),
        count,
        tokens,
        base_version,
        version,
        digest(new_bits, kind),
    ) + struct.pack(f"<{new.dim()}q", *new.shape)
    head_bytes = torch.frombuffer(bytearray(head), dtype=torch.uint8).to(new.device)
    return torch.cat([head_bytes, *sections])


def header(payload: torch.Tensor) -> DeltaHeader:
    """The header of a payload, checked (DeltaError if it is not one this format reads); of a device
    payload only the header's bytes cross to the host."""
    if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8 or payload.dim() != 1:
        raise DeltaError(f"payload: expected a flat uint8 tensor, got {getattr(payload, 'dtype', type(payload))}")
    if payload.numel() < HEADER_NBYTES:
        raise DeltaError(f"payload: {payload.numel()} bytes; need at least a header's {HEADER_NBYTES}")
    data = payload[: HEADER_NBYTES + 8 * MAX_NDIM].cpu().numpy()
    magic, fmt, enc, kind, size, dtype, ndim, numel, count, tokens, base, version, hashed = _FIXED.unpack(
        data[:HEADER_NBYTES].tobytes()
    )
    if magic != MAGIC or fmt != FORMAT or enc >= len(ENCODINGS) or dtype >= len(DTYPES):
        raise DeltaError(f"payload: not a delta of format {FORMAT} (magic {magic!r}, format {fmt}, encoding {enc})")
    if kind not in (CRC32, SUM64):
        raise DeltaError(f"payload: hash kind {kind} is not CRC32 ({CRC32}) or SUM64 ({SUM64})")
    if data.size < HEADER_NBYTES + 8 * ndim:
        raise DeltaError(f"payload: {data.size} bytes, too short for its header's {ndim} dims")
    shape = struct.unpack(f"<{ndim}q", data[HEADER_NBYTES : HEADER_NBYTES + 8 * ndim].tobytes())
    if size != DTYPES[dtype].itemsize or math.prod(shape) != numel or count > numel:
        raise DeltaError(f"payload: inconsistent header (element size {size}, shape {shape}, numel {numel})")
    return DeltaHeader(ENCODINGS[enc], size, DTYPES[dtype], shape, count, tokens, base, version, kind, hashed)


def apply(payload: torch.Tensor, target: torch.Tensor, base_version: int) -> int:
    """Overwrite the changed elements of `target` (a contiguous tensor on the payload's device holding `base_version`'s
    bits of this tensor, any dtype of the payload's element size) and return the version produced.
    DeltaError before anything is written: the header does not match the target (element size,
    numel), the payload is malformed, or it applies on another version than `base_version`.
    DeltaError after writing: the target's hash is not the payload's, so the target now holds
    neither version and only a full anchor repairs it."""
    head = header(payload)
    if head.base_version != base_version:
        raise DeltaError(f"payload: applies on version {head.base_version}, the target holds {base_version}")
    _write(payload, head, target)
    if digest(bits(target), head.hash_kind) != head.hash:
        raise DeltaError(f"hash mismatch after applying version {head.version}: the target is corrupt, load an anchor")
    return head.version


def digest(elements: torch.Tensor, kind: int) -> int:
    """The hash of a flat integer view of a tensor's elements (`bits`), computed where it lives.
    CRC32: zlib's CRC-32 of the bytes (on the host; a device tensor is copied there first).
    SUM64: sum over i of element_i x (i x _SUM64_STEP + 1), mod 2**64, each element read as the
    integer `bits` views it as (uint8 for 1 byte, signed otherwise): torch integer ops on the
    tensor's own device, chunked. Every weight is odd, so any one changed element changes the sum."""
    if kind == CRC32:
        return zlib.crc32(elements.cpu().numpy().view(np.uint8))
    if kind != SUM64:
        raise ValueError(f"hash kind {kind}: expected CRC32 ({CRC32}) or SUM64 ({SUM64})")
    return sum64(elements)


def sum64(elements: torch.Tensor, positions: torch.Tensor | None = None) -> int:
    """SUM64 (`digest`) of flat integer `elements` standing at `positions` of their tensor (int64, on
    the elements' device; None: 0..n-1). A sum over elements, so the sums of disjoint parts of a
    tensor add up, mod 2**64, to the whole tensor's: what SGLang's TP ranks check a delta with."""
    total = torch.zeros((), dtype=torch.int64, device=elements.device)  # one sync, at the end
    for start in range(0, elements.numel(), SUM64_CHUNK):
        chunk = elements[start : start + SUM64_CHUNK].to(torch.int64)
        if positions is None:
            weights = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=chunk.device)
        else:
            weights = positions[start : start + SUM64_CHUNK]
        total += (chunk * (weights * _SUM64_STEP + 1)).sum()  # int64 products and sums wrap mod 2**64
    return int(total) % (1 << 64)


def _write(payload: torch.Tensor, head: DeltaHeader, target: torch.Tensor) -> None:
    """Write a checked header's payload into `target` (on its device): `apply` without the hash, for a
    sender's kept copy of bytes it has just hashed itself. DeltaError before anything is written if
    the payload does not fit the target."""
    if target.element_size() != head.element_size or target.numel() != head.numel:
        raise DeltaError(
            f"target: {target.element_size()}-byte x {target.numel()} elements, the payload is for "
            f"{head.element_size}-byte x {head.numel}"
        )
    if payload.device != target.device or not target.is_contiguous():
        raise ValueError(
            f"payload on {payload.device}, target on {target.device} {target.stride()}: both must be on one device, "
            "the target contiguous"
        )
    elements = bits(target)  # shares target's memory
    where, values = changes(payload, head)
    if where is None:
        elements.copy_(values)
    else:
        elements[where] = values


def changes(payload: torch.Tensor, head: DeltaHeader) -> tuple[torch.Tensor | None, torch.Tensor]:
    """A checked payload's changed elements, decoded on the payload's device: where they are
    (ascending int64 positions, a bool mask of numel for a bitmap, or None for every element:
    dense) and their bits (as `bits` views the dtype). DeltaError if the body disagrees with its
    header."""
    if payload.numel() != head.nbytes:
        raise DeltaError(f"payload: {payload.numel()} bytes, its header describes {head.nbytes}")
    body = payload[HEADER_NBYTES + 8 * len(head.shape) :]
    dtype = _BITS[head.element_size]
    if head.encoding == "dense":  # every element, whatever the count of changed ones
        return None, _as(body, dtype)
    values = _as(body[body.numel() - head.count * head.element_size :], dtype)  # the last section
    if head.encoding == "gaps":
        return _positions(_as(body[: 2 * head.tokens], torch.int16), head), values
    if head.encoding == "bitmap":
        packed = body[: math.ceil(head.numel / 8)]
        shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
        mask = ((packed.unsqueeze(1) >> shifts) & 1).view(-1)[: head.numel].bool()  # bit i of byte i // 8
        if (marked := int(mask.sum())) != head.count:
            raise DeltaError(f"payload: the bitmap marks {marked} elements, the header {head.count}")
        return mask, values
    return torch.zeros(0, dtype=torch.int64, device=payload.device), values  # none


@dataclass
class DeltaStats:
    """What one `KeptCopy.encode_stream` sent (an anchor counts every element as changed)."""

    version: int
    anchor: bool
    elements: int = 0
    changed: int = 0
    dense_bytes: int = 0
    """The tensors' own bytes (what a full update sends)."""
    wire_bytes: int = 0
    encode_s: float = 0.0
    """Seconds inside the stream (encoding, hashing, updating the kept copy), not the consumer's."""

    @property
    def changed_fraction(self) -> float:
        return self.changed / self.elements if self.elements else 0.0

    @property
    def wire_fraction(self) -> float:
        return self.wire_bytes / self.dense_bytes if self.dense_bytes else 0.0


class KeptCopy:
    """A sending rank's memory of the bytes it last sent, per tensor name, on the host (pinned where
    CUDA is available): the bytes the engines hold at `version` once that update committed.
    Memory: one version of this rank's tensors (`nbytes`), besides `encode`'s transient buffers.

    `version` is None before the first anchor, while a stream is under way (the kept bytes are
    updated as it goes) and after `invalidate`: a delta then is refused, the next update is a full
    anchor. The sender calls `invalidate()` when an update did not commit on every engine."""

    def __init__(self):
        self.tensors: dict[str, torch.Tensor] = {}
        self.version: int | None = None
        self.stats: DeltaStats | None = None
        self._pin = torch.cuda.is_available()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def invalidate(self) -> None:
        """Forget which version the engines hold (the next update must be a full anchor)."""
        self.version = None

    def encode_stream(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        full: bool,
        encoding: str = "auto",
        owned: Container[str] = (),
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) unchanged for a full anchor (`full`), else (name, payload) against the kept
        bytes at `self.version` (a tensor never sent, or of another shape or dtype, goes dense). The
        kept copy follows as the stream goes and holds `version` once the stream is exhausted; an
        anchor forgets the names it did not carry. RuntimeError for a delta with no version kept.

        `owned`: names their owners encoded and keep (`sync.owner`: experts diffed before the EP
        gather): they pass unchanged (a delta's are payloads already), counted in the stats (a
        payload by its header), never kept here."""
        if not full and self.version is None:
            raise RuntimeError("delta without a kept version: send a full anchor first (full=True)")
        if encoding not in DELTA_ENCODINGS:
            raise ValueError(f"encoding: {encoding!r} is not one of {DELTA_ENCODINGS}")
        base, self.version = self.version, None
        stats = self.stats = DeltaStats(version=version, anchor=full)
        seen = set()
        for name, tensor in named_tensors:
            start = time.perf_counter()
            if name in owned:
                out, numel, size, changed = tensor, tensor.numel(), tensor.element_size(), tensor.numel()
                if not full:  # the header alone (of a device payload, only its bytes cross)
                    head = header(tensor)
                    numel, size, changed = head.numel, head.element_size, head.count
            else:
                if full:
                    self.keep(name, tensor)
                    out = tensor
                else:
                    out = self.encode_one(name, tensor, base, version, diff=True, encoding=encoding)
                numel, size = tensor.numel(), tensor.element_size()
                changed = numel if full else header(out).count
                seen.add(name)
            stats.elements += numel
            stats.changed += changed
            stats.dense_bytes += numel * size
            stats.wire_bytes += out.numel() * out.element_size()
            stats.encode_s += time.perf_counter() - start
            yield name, out
        if full:
            self.tensors = {name: t for name, t in self.tensors.items() if name in seen}
        self.version = version

    def encode_one(
        self, name: str, tensor: torch.Tensor, base: int, version: int, diff: bool, encoding: str = "auto"
    ) -> torch.Tensor:
        """One tensor's payload from `base` to `version`, on `tensor`'s device: against the kept bytes
        of `name` when `diff` and they are of its shape and dtype, else dense (still naming `base`);
        the kept bytes become `tensor`'s. The caller names the kept version once the whole version
        went (`sync.owner`).

        The compare runs where `tensor` lives: the kept bytes go up to it (one pass over PCIe, pinned)
        and only the payload comes back, its changed elements written into the kept bytes (few)."""
        kept, held = self._slot(name, tensor)
        tensor = tensor.detach()
        if not (held and diff):
            kept.copy_(tensor)
            return encode(tensor, None, base, version, encoding)
        out = encode(tensor, kept.to(tensor.device, non_blocking=True), base, version, encoding)
        host = out.cpu()
        _write(host, header(host), kept)
        return out

    def keep(self, name: str, tensor: torch.Tensor) -> None:
        """Keep `tensor` as `name`'s bytes, as sent in full (an anchor)."""
        kept, _ = self._slot(name, tensor)
        kept.copy_(tensor.detach())

    def _slot(self, name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The host storage that keeps `name` and whether it holds earlier bytes of `tensor`'s shape
        and dtype (else it is fresh)."""
        kept = self.tensors.get(name)
        if kept is not None and kept.shape == tensor.shape and kept.dtype == tensor.dtype:
            return kept, True
        self.tensors[name] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self._pin)
        return self.tensors[name], False


class AppliedCopy:
    """An engine's copy of the bytes it was sent (name -> host tensor) at `version`, what the next
    delta applies on; for engines that keep them (the embedded engine's receiver, a receiver-only
    engine). Staged, as an engine commits: `stage` makes each tensor of the next version beside the
    held one, `hold` takes a committed version (its tensors, not copies), so a version that never
    commits leaves the copy as it was. Memory: the held version, plus a copy of each changed tensor
    while a version is staged (an unchanged one is the held tensor itself).

    `version` is None before the first anchor: the copy then refuses deltas. The staged version's
    bookkeeping (the tensors its payloads carried, the versions they produce: `produced`) lives here
    until `hold` or `discard`; `stage` may run on several threads at once (an engine's buckets)."""

    def __init__(self):
        self.tensors: dict[str, torch.Tensor] = {}
        self.version: int | None = None
        self.produced: set[int] = set()  # the versions the staged payloads produce
        self._names: set[str] = set()  # the tensors the staged payloads carried
        self._lock = threading.Lock()

    @property
    def needs_anchor(self) -> bool:
        return self.version is None

    def stage(self, name: str, payload: torch.Tensor, out: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        """The tensor `payload` makes of the held `name` and the version it produces, written into
        `out` where given (storage of the payload's dtype and shape), else into a copy (an unchanged
        tensor: the held one itself); the held copy is left as it is. DeltaError if the copy needs an
        anchor, the payload applies on another version, `name` is not held as the payload's dtype and
        shape (unless the payload is dense), the staged version already has a payload of `name` (a
        duplicated bucket), or the result fails its hash."""
        if self.version is None:
            raise DeltaError(f"{name}: a delta arrived but this engine holds no anchor; send a full version")
        with self._lock:
            if name in self._names:
                raise DeltaError(f"{name}: two payloads in one version (a duplicated bucket)")
            self._names.add(name)
        head = header(payload)
        if head.base_version != self.version:
            raise DeltaError(
                f"{name}: the delta applies on version {head.base_version}, this engine holds {self.version}"
            )
        held = self.tensors.get(name)
        if head.encoding != "dense" and (held is None or held.shape != head.shape or held.dtype != head.dtype):
            raise DeltaError(f"{name}: not held here as {head.dtype}{list(head.shape)}; send a full version")
        if out is not None:
            target = out
            if head.encoding != "dense":
                target.copy_(held)
        elif head.encoding == "dense":
            target = torch.empty(head.shape, dtype=head.dtype)
        else:  # unchanged: the held tensor itself, its hash checked; changed: a copy to write into
            target = held if head.encoding == "none" else held.clone()
        version = apply(payload, target, self.version)
        with self._lock:
            self.produced.add(version)
        return target, version

    def hold(self, tensors: dict[str, torch.Tensor], version: int | None) -> None:
        """The committed `version` is `tensors` (kept as they are: the caller does not write them
        again); None: a version nobody can name, so the copy refuses deltas until an anchor."""
        self.tensors, self.version = dict(tensors), version
        self.discard()

    def discard(self) -> None:
        """Forget the staged version's bookkeeping (it was dropped, or committed)."""
        with self._lock:
            self.produced, self._names = set(), set()

    def apply_stream(self, named_payloads: Iterable[tuple[str, torch.Tensor]], base_version: int) -> int:
        """Stage and hold one whole delta version (`KeptCopy.encode_stream`'s, every payload on
        `base_version`); returns the version produced. DeltaError, the copy unchanged, if the copy
        holds another version, a payload does not apply, two payloads name one tensor, payloads
        produce different versions, or a held tensor got no payload (a lost bucket)."""
        if self.version != base_version:
            raise DeltaError(f"the stream applies on version {base_version}, the copy holds {self.version}")
        staged: dict[str, torch.Tensor] = {}
        try:
            for name, payload in named_payloads:
                staged[name], _ = self.stage(name, payload)
            check_complete(staged, self.tensors, self.produced)
        except DeltaError:
            self.discard()
            raise
        (version,) = self.produced
        self.hold(staged, version)
        return version


def check_complete(staged: dict[str, torch.Tensor], held: dict[str, torch.Tensor], produced: set[int]) -> None:
    """DeltaError unless a staged delta version covers every held tensor and names one version."""
    if missing := sorted(set(held) - set(staged)):
        raise DeltaError(f"{len(missing)} tensors got no payload (a lost bucket?), e.g. {missing[0]}")
    if len(produced) != 1:
        raise DeltaError(f"the payloads produce versions {sorted(produced)}, not one")


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The flat integer view of `tensor`'s elements, on its device (contiguous copy only when needed):
    what deltas compare and hash, so NaN payloads and -0.0 count as the bits they are."""
    if tensor.element_size() not in _BITS:
        raise ValueError(f"{tensor.dtype}: delta sync carries elements of 1, 2, 4 or 8 bytes")
    return tensor.detach().contiguous().view(-1).view(_BITS[tensor.element_size()])


def _dtype_id(dtype: torch.dtype) -> int:
    if dtype not in DTYPES:
        raise ValueError(f"{dtype}: delta sync carries the dtypes {[str(d) for d in DTYPES]}")
    return DTYPES.index(dtype)


def _gaps(positions: torch.Tensor) -> torch.Tensor:
    """Unchanged elements before each changed position (ascending int64 positions)."""
    return torch.diff(positions, prepend=positions.new_tensor([-1])) - 1


def _gap_tokens(positions: torch.Tensor) -> torch.Tensor:
    """The gaps encoding's u16 tokens (as int32) of ascending positions (contract point 5)."""
    gaps = _gaps(positions)
    ends = torch.cumsum(gaps // ESCAPE + 1, 0) - 1  # each gap's last token; escapes fill the rest
    tokens = torch.full((int(ends[-1]) + 1,), ESCAPE, dtype=torch.int32, device=positions.device)
    tokens[ends] = (gaps % ESCAPE).to(torch.int32)
    return tokens


def _positions(tokens: torch.Tensor, head: DeltaHeader) -> torch.Tensor:
    """The changed positions the gap tokens (u16 read as int16) mark; DeltaError if they disagree
    with the header."""
    tokens = tokens.to(torch.int64) & ESCAPE
    escape = tokens == ESCAPE
    positions = (torch.cumsum(torch.where(escape, ESCAPE, tokens + 1), 0) - 1)[~escape]
    if positions.numel() != head.count or (positions.numel() and int(positions[-1]) >= head.numel):
        raise DeltaError(f"payload: the gap tokens mark {positions.numel()} positions, not {head.count} within numel")
    return positions


def _as(section: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A flat uint8 section read as `dtype` (copied first where its offset is not aligned to it)."""
    try:
        return section.view(dtype)
    except RuntimeError:
        return section.clone().view(dtype)


def _pad8(n: int) -> int:
    return (n + 7) // 8 * 8


def _padded(section: torch.Tensor) -> torch.Tensor:
    """A flat uint8 body section zero-padded to a multiple of 8 bytes (contract point 5)."""
    return torch.cat([section, section.new_zeros(_pad8(section.numel()) - section.numel())])


def _packbits(mask: torch.Tensor) -> torch.Tensor:
    """A flat bool mask as ceil(n / 8) bytes, element i in bit i % 8 of byte i // 8 (numpy's
    packbits, bitorder little), on the mask's device."""
    padded = mask.new_zeros(_pad8(mask.numel()), dtype=torch.uint8)  # ceil(n / 8) rows of 8
    padded[: mask.numel()] = mask
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=mask.device)
    return (padded.view(-1, 8) * weights).sum(1).to(torch.uint8)


def _changed(mask: torch.Tensor) -> torch.Tensor:
    """Ascending int64 positions of the set elements of a flat bool mask."""
    return torch.nonzero(mask).view(-1)
