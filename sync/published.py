"""Versions published on shared storage: full anchors and zstd-compressed delta files.

The disk transport (`sync.transports.disk`) writes one directory per version, `v{N}/`, and an
engine that loads it resolves what it needs:
- an anchor: `model-*.safetensors` shards of the full version, as any HF loader (SGLang included)
  reads them;
- a delta (`sync.delta` payloads, with `sync.delta.enabled`): `delta.json` (`{"format": FORMAT,
  "base_version": B, "version": N}`) and `delta-*.safetensors.zst`, each a zstd-compressed
  safetensors file of payloads (uint8, one per tensor, under the tensor's own name). A delta
  applies on exactly `v{B}`.

`resolve` turns a version's directory into the full tensors: it walks the chain back from `v{N}`
to the version the engine already holds, or else to the last anchor, then applies every delta
forward, each tensor checked by its payload's hash (`sync.delta.AppliedCopy.apply_stream`). So an
engine that restarted, or joined the run late, catches up from storage alone: the trainer
exports nothing new for it. A link missing from the chain, a corrupt file or a failed hash raises
ValueError before anything is served: only an anchor repairs that.

Retention (`prune`): the last anchor and every delta after it stay; older versions go.
Memory while resolving: the base version plus one delta's payloads and the tensors it changes.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable

import torch
import zstandard
from safetensors.torch import load, load_file, save, save_file

from sync.delta import AppliedCopy, DeltaError, header

FORMAT = "moe-rl-delta/1"
META = "delta.json"
_LEVEL = 3  # zstd's default: most of the ratio at a few hundred MB/s; each frame checksummed (XXH64)


def version_dir(root: Path, version: int) -> Path:
    return root / f"v{version}"


def is_delta(path: Path) -> bool:
    return (path / META).is_file()


def publish(
    root: Path, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, bucket_bytes: int, delta: bool
) -> int:
    """Write `v{version}/` under `root` (a hidden directory renamed at the end, so a reader never sees
    half a version) from the stream: full tensors, or `sync.delta` payloads where `delta` (their base
    version read from the payloads' headers). Returns the bytes written before compression."""
    tmp = Path(tempfile.mkdtemp(prefix=f".v{version}-", dir=root))
    nbytes, shard, shard_bytes, index, bases = 0, {}, 0, 0, set()
    try:
        for name, tensor in named_tensors:
            size = tensor.numel() * tensor.element_size()
            if shard and shard_bytes + size > bucket_bytes:
                _write(tmp, index, shard, delta)
                shard, shard_bytes, index = {}, 0, index + 1
            if delta:
                bases.add(header(tensor).base_version)
            shard[name] = tensor.detach().contiguous().cpu()
            shard_bytes += size
            nbytes += size
        if shard:
            _write(tmp, index, shard, delta)
        if delta:
            if len(bases) != 1:
                raise ValueError(f"delta of version {version}: payloads apply on versions {sorted(bases)}, not one")
            meta = {"format": FORMAT, "base_version": bases.pop(), "version": version}
            (tmp / META).write_text(json.dumps(meta))
        os.rename(tmp, version_dir(root, version))  # atomic publish
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return nbytes


def _write(directory: Path, index: int, shard: dict[str, torch.Tensor], delta: bool) -> None:
    if delta:
        data = zstandard.ZstdCompressor(level=_LEVEL, write_checksum=True).compress(save(shard))
        (directory / f"delta-{index:05d}.safetensors.zst").write_bytes(data)
    else:
        save_file(shard, directory / f"model-{index:05d}.safetensors")


def prune(root: Path) -> None:
    """Remove every version older than the newest anchor (a delta's chain starts there)."""
    versions = sorted(_published(root))
    anchors = [v for v in versions if not is_delta(version_dir(root, v))]
    for version in versions:
        if anchors and version < anchors[-1]:
            shutil.rmtree(version_dir(root, version), ignore_errors=True)


def _published(root: Path) -> list[int]:
    return [int(p.name[1:]) for p in root.glob("v*") if p.is_dir() and p.name[1:].isdigit()]


def resolve(path: Path, held: AppliedCopy | None = None) -> tuple[dict[str, torch.Tensor], int | None]:
    """The full tensors that the version directory `path` publishes, and its version (None for a
    directory that is not a delta and is not named `v{N}`: a plain checkpoint). `held`: the
    engine's copy of the version it serves, where the chain may start instead of an anchor (it is
    left unchanged). ValueError names the broken link or the failed check."""
    path = Path(path)
    chain = []
    while is_delta(path):
        meta = _meta(path)
        chain.append(path)
        if held is not None and held.version == meta["base_version"]:
            base = held
            break
        path = version_dir(path.parent, meta["base_version"])
        if not path.is_dir():
            raise ValueError(
                f"{chain[-1]}: applies on version {meta['base_version']}, but {path} is not published "
                "(pruned, or never written): the sender must publish a full anchor"
            )
    else:
        base = AppliedCopy()
        base.hold(_load_anchor(path), int(path.name[1:]) if path.name[1:].isdigit() else None)
        if not chain:
            return base.tensors, base.version
    copy = AppliedCopy()
    copy.hold(base.tensors, base.version)
    for link in reversed(chain):
        try:
            copy.apply_stream(_payloads(link).items(), copy.version)
        except DeltaError as error:
            raise ValueError(f"{link}: {error}") from None
    return copy.tensors, copy.version


def _meta(path: Path) -> dict:
    meta = json.loads((path / META).read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path / META}: format {meta.get('format')!r}, this reader takes {FORMAT!r}")
    return meta


def _load_anchor(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files (an anchor) and no {META} (a delta)")
    tensors = {}
    for file in files:
        tensors.update(load_file(file))
    return tensors


def _payloads(path: Path) -> dict[str, torch.Tensor]:
    payloads = {}
    decompressor = zstandard.ZstdDecompressor()
    for file in sorted(path.glob("delta-*.safetensors.zst")):
        try:
            payloads.update(load(decompressor.decompress(file.read_bytes())))
        except Exception as error:  # zstd's and safetensors' own error types, and a truncated file's
            raise ValueError(f"{file}: unreadable ({error}); the engine needs a full anchor") from None
    return payloads
