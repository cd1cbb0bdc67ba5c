"""HF checkpoint files: read slices from safetensors (single file or sharded with an index),
and write `(name, tensor)` streams as safetensors shards + index + config.

Writing is collective-free: each writer (one per pipeline stage) writes its own shards under
a common temporary directory; `finalize_hf_checkpoint` (one rank) renames them to HF's
`model-0000i-of-0000N.safetensors`, writes the index and config, and moves the directory into
place, so an interrupted conversion never leaves a half-written checkpoint at `out_dir`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def check_safetensors(path: str | os.PathLike) -> None:
    """ValueError naming `path` unless it is a whole safetensors file: a readable header whose
    tensors all end inside the file (a truncated copy fails here, before any model is built)."""
    path = Path(path)
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            if size < 8 or header_len > size - 8:
                raise ValueError("the header is cut off")
            header = json.loads(f.read(header_len))
        ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path} is not a readable safetensors file ({error}): copy it again") from None
    if 8 + header_len + max(ends, default=0) > size:
        raise ValueError(f"{path} is truncated: its header needs {8 + header_len + max(ends)} bytes, the file "
                         f"has {size}; copy it again")


class HFCheckpointReader:
    """Lazy reader of an HF safetensors checkpoint: reads only the requested slices.
    `single_file`: the file of an unsharded checkpoint (a PEFT adapter's is adapter_model.safetensors)."""

    def __init__(self, hf_dir: str | os.PathLike, single_file: str = SINGLE_FILE):
        self.dir = Path(hf_dir)
        index = self.dir / INDEX_FILE
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.dir / single_file).exists():
            with safe_open(self.dir / single_file, "pt") as f:
                weight_map = {name: single_file for name in f.keys()}
        else:
            raise ValueError(f"{self.dir} has neither {INDEX_FILE} nor {single_file}: pass an HF "
                             f"checkpoint directory saved with safetensors")
        self.weight_map: dict[str, str] = weight_map
        for file in sorted(set(weight_map.values())):
            check_safetensors(self.dir / file)
        self._files: dict[str, Any] = {}

    def names(self) -> set[str]:
        return set(self.weight_map)

    def _slice(self, name: str):
        if name not in self.weight_map:
            raise ValueError(f"HF checkpoint {self.dir} has no tensor {name!r}: the bridge expects it "
                             f"(wrong architecture or config, or an adapter lora.target_modules does not match?)")
        file = self.weight_map[name]
        if file not in self._files:
            self._files[file] = safe_open(self.dir / file, "pt")
        return self._files[file].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        tensor_slice = self._slice(name)
        if dim is None:
            return tensor_slice[:]
        index = (slice(None),) * dim + (slice(start, stop),)
        return tensor_slice[index]

    def close(self) -> None:
        self._files.clear()


def load_hf_config(hf_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(hf_dir) / "config.json"
    if not path.exists():
        raise ValueError(f"{hf_dir} has no config.json: pass an HF model directory")
    return json.loads(path.read_text())


def write_shards(items: Iterable[tuple[str, torch.Tensor]], tmp_dir: str | os.PathLike, prefix: str,
                 max_shard_bytes: int, progress=None) -> dict[str, str]:
    """Write a stream to `tmp_dir/{prefix}-{k}.safetensors` files of at most `max_shard_bytes`
    (one tensor larger than that gets a file of its own). Returns {name: file}. Memory: one shard."""
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    size, count = 0, 0

    def flush():
        nonlocal shard, size, count
        file = f"{prefix}-{count:05d}.safetensors"
        save_file(shard, str(Path(tmp_dir) / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
        shard, size, count = {}, 0, count + 1

    for name, tensor in items:
        if name in weight_map or name in shard:
            raise ValueError(f"tensor {name!r} exported twice: two Megatron parameters map to it")
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > max_shard_bytes:
            flush()
        shard[name] = tensor.contiguous().clone() if tensor.storage_offset() else tensor.contiguous()
        size += nbytes
        if progress is not None:
            progress(nbytes)
    if shard:
        flush()
    return weight_map


def finalize_hf_checkpoint(tmp_dir: str | os.PathLike, out_dir: str | os.PathLike, weight_map: dict[str, str],
                           hf_config: dict[str, Any], extra_files: dict[str, bytes] | None = None) -> None:
    """Rename shards to HF's numbering, write index + config + `extra_files`, then move
    `tmp_dir` to `out_dir` (replacing it). One rank calls it, after every writer finished."""
    tmp, out = Path(tmp_dir), Path(out_dir)
    files = sorted(set(weight_map.values()))
    renamed = {old: f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i, old in enumerate(files)}
    for old, new in renamed.items():
        (tmp / old).rename(tmp / new)
    total = sum((tmp / f).stat().st_size for f in renamed.values())
    index = {"metadata": {"total_size": total},
             "weight_map": {name: renamed[file] for name, file in sorted(weight_map.items())}}
    (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2))
    (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
    for name, data in (extra_files or {}).items():  # tokenizer, generation config
        (tmp / name).write_bytes(data)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
