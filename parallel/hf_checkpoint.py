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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from parallel.bridges import without_mtp
from parallel.fp8 import SCALE_SUFFIX, BlockFP8
from parallel.staging import publish

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
        raise ValueError(
            f"{path} is truncated: its header needs {8 + header_len + max(ends)} bytes, the file "
            f"has {size}; copy it again"
        )


class HFCheckpointReader:
    """Lazy reader of an HF safetensors checkpoint: reads only the requested slices.
    `single_file`: the file of an unsharded checkpoint (a PEFT adapter's is adapter_model.safetensors).

    What it shows is what the bridges map, whatever the checkpoint's storage:
      - block-scaled FP8 weights (`quantization_config`, `parallel.fp8`) read as float32,
        dequantized; their `*.weight_scale_inv` are consumed with them and not listed;
      - experts stored fused the transformers-5 way (`mlp.experts.gate_up_proj` [E, 2I, H],
        `mlp.experts.down_proj` [E, H, I]) read as per-expert `mlp.experts.{e}.gate_proj.weight`,
        `up_proj.weight`, `down_proj.weight` (gate is the first half of gate_up, as transformers
        chunks it);
      - `rotary_emb.inv_freq` buffers (recomputed from the config by every model) are not listed
        (`ignored` names them).
    """

    def __init__(self, hf_dir: str | os.PathLike, single_file: str = SINGLE_FILE):
        self.dir = Path(hf_dir)
        index = self.dir / INDEX_FILE
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.dir / single_file).exists():
            with safe_open(self.dir / single_file, "pt") as f:
                weight_map = {name: single_file for name in f.keys()}
        else:
            raise ValueError(
                f"{self.dir} has neither {INDEX_FILE} nor {single_file}: pass an HF "
                f"checkpoint directory saved with safetensors"
            )
        self.weight_map: dict[str, str] = weight_map
        for file in sorted(set(weight_map.values())):
            check_safetensors(self.dir / file)
        self._files: dict[str, Any] = {}
        config = self.dir / "config.json"
        self.config: dict[str, Any] = json.loads(config.read_text()) if config.exists() else {}
        self.fp8 = BlockFP8.from_hf_config(self.config)
        self.ignored = sorted(n for n in weight_map if n.endswith(".rotary_emb.inv_freq"))
        self._views = self._fused_expert_views()
        hidden = (
            set(self.ignored)
            | {v.fused for v in self._views.values()}
            | {  # listed as what they stand for
                n
                for n in weight_map
                if self.fp8 and n.endswith(SCALE_SUFFIX) and n.removesuffix(SCALE_SUFFIX) in weight_map
            }
        )
        self._names = (set(weight_map) - hidden) | set(self._views)

    def _fused_expert_views(self) -> dict[str, _ExpertView]:
        views = {}
        for name in self.weight_map:
            if not name.endswith(".mlp.experts.gate_up_proj"):
                continue
            prefix = name.removesuffix("gate_up_proj")
            down = prefix + "down_proj"
            gate_up, down_shape = self.shape(name, stored=True), self.shape(down, stored=True)
            experts, rows, hidden = gate_up
            if len(down_shape) != 3 or down_shape[0] != experts or down_shape[1] != hidden or rows != 2 * down_shape[2]:
                raise ValueError(
                    f"{self.dir}: fused experts {name} {tuple(gate_up)} and {down} {tuple(down_shape)} "
                    "are not transformers' [E, 2I, H] and [E, H, I] layout"
                )
            half = rows // 2
            for e in range(experts):
                views[f"{prefix}{e}.gate_proj.weight"] = _ExpertView(name, e, 0, half)
                views[f"{prefix}{e}.up_proj.weight"] = _ExpertView(name, e, half, half)
                views[f"{prefix}{e}.down_proj.weight"] = _ExpertView(down, e, 0, hidden)
        return views

    def names(self) -> set[str]:
        return set(self._names)

    def mtp_names(self) -> set[str]:
        """The tensors of multi-token-prediction layers (DeepSeek-V3, GLM-4.5:
        `model.layers.{num_hidden_layers + i}.*`, i < num_nextn_predict_layers), from the headers."""
        first = self.config.get("num_hidden_layers", 0)
        count = self.config.get("num_nextn_predict_layers") or 0
        prefixes = tuple(f"model.layers.{first + i}." for i in range(count))
        return {name for name in self._names if prefixes and name.startswith(prefixes)}

    def _slice(self, name: str):
        if name not in self.weight_map:
            raise ValueError(
                f"HF checkpoint {self.dir} has no tensor {name!r}: the bridge expects it "
                f"(wrong architecture or config, or an adapter lora.target_modules does not match?)"
            )
        file = self.weight_map[name]
        if file not in self._files:
            self._files[file] = safe_open(self.dir / file, "pt")
        return self._files[file].get_slice(name)

    def shape(self, name: str, stored: bool = False) -> tuple[int, ...]:
        view = None if stored else self._views.get(name)
        if view is not None:
            return (view.rows, self.shape(view.fused, stored=True)[2])
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The tensor `name`, or its [start, stop) along `dim` only."""
        shape = self.shape(name)
        index = [slice(0, size) for size in shape]
        if dim is not None:
            index[dim] = slice(*slice(start, stop).indices(shape[dim])[:2])
        view = self._views.get(name)
        if view is None:
            return self._read(name, index)
        rows = index[0]
        return self._read(view.fused, [view.expert, slice(view.row0 + rows.start, view.row0 + rows.stop), index[1]])

    def _read(self, name: str, index: list) -> torch.Tensor:
        """A region of a stored tensor (ints and slices, one per dim), dequantized if FP8."""
        scale = name + SCALE_SUFFIX
        if self.fp8 is None or scale not in self.weight_map:
            return self._slice(name)[tuple(index)]
        (r0, r1), (c0, c1) = (self.fp8.block_span(index[d].start, index[d].stop, d) for d in (-2, -1))
        blocks = self._slice(scale)[(*index[:-2], slice(r0, r1), slice(c0, c1))]
        return self.fp8.dequantize(self._slice(name)[tuple(index)], blocks, index[-2].start, index[-1].start)

    def close(self) -> None:
        self._files.clear()


@dataclass(frozen=True)
class _ExpertView:
    """Rows [row0, row0 + rows) of expert `expert` in the stored 3-D tensor `fused`."""

    fused: str
    expert: int
    row0: int
    rows: int


def load_hf_config(hf_dir: str | os.PathLike) -> dict[str, Any]:
    """config.json of `hf_dir`, as its weights hold it (`as_stored`)."""
    path = Path(hf_dir) / "config.json"
    if not path.exists():
        raise ValueError(f"{hf_dir} has no config.json: pass an HF model directory")
    return as_stored(json.loads(path.read_text()), hf_dir)


def declares_absent_mtp(hf_dir: str | os.PathLike) -> bool:
    """config.json counts MTP layers (num_nextn_predict_layers) that no safetensors file holds:
    transformers' DeepSeek-V3 and GLM-4.5 configs default to one, and their save_pretrained never
    writes it (fine-tunes saved that way). False for a directory without weights."""
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    if not (config.get("num_nextn_predict_layers") or 0) or not any(Path(hf_dir).glob("*.safetensors")):
        return False
    return not HFCheckpointReader(hf_dir).mtp_names()


def as_stored(hf_config: Any, hf_dir: str | os.PathLike) -> Any:
    """`hf_config` (a dict or a transformers config) without the MTP layers it declares when the
    checkpoint at `hf_dir` holds none (`declares_absent_mtp`): the model is built as stored."""
    return without_mtp(hf_config) if declares_absent_mtp(hf_dir) else hf_config


def write_shards(
    items: Iterable[tuple[str, torch.Tensor]],
    tmp_dir: str | os.PathLike,
    prefix: str,
    max_shard_bytes: int,
    progress=None,
) -> dict[str, str]:
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


def finalize_hf_checkpoint(
    tmp_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    weight_map: dict[str, str],
    hf_config: dict[str, Any],
    extra_files: dict[str, bytes] | None = None,
) -> None:
    """Rename shards to HF's numbering, write index + config + `extra_files`, then move
    `tmp_dir` to `out_dir` (replacing it). One rank calls it, after every writer finished."""
    tmp, out = Path(tmp_dir), Path(out_dir)
    files = sorted(set(weight_map.values()))
    renamed = {old: f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i, old in enumerate(files)}
    for old, new in renamed.items():
        (tmp / old).rename(tmp / new)
    total = sum((tmp / f).stat().st_size for f in renamed.values())
    index = {
        "metadata": {"total_size": total},
        "weight_map": {name: renamed[file] for name, file in sorted(weight_map.items())},
    }
    (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2))
    (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
    for name, data in (extra_files or {}).items():  # tokenizer, generation config
        (tmp / name).write_bytes(data)
    publish(tmp, out)
