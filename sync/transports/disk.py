"""Disk transport: safetensors on storage shared with the engines (no NCCL between the jobs).

`send` writes the stream as safetensors shards of at most `bucket_bytes` into a hidden temporary
directory under `disk_dir`, then publishes it with one atomic rename to `disk_dir/v{version}`,
so an engine never sees a half-written version; then every engine is told, concurrently,
through `update_weights_from_disk(model_path, weight_version)`. After the sender commits, the
previous published versions are removed at the next `send`. Sending a version that is already
published (the sender catching a restarted engine up to the committed version) writes nothing:
the export is exhausted and the engines load the published directory.

Memory on the source rank: one shard (the tensors of at most `bucket_bytes`, held until written).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable

import torch
from safetensors.torch import save_file

from sync.engine_set import EngineSet, SyncError, describe
from sync.transports.base import Transport


class DiskTransport(Transport):
    name = "disk"
    session = False  # SGLang's /update_weights_from_disk loads outside a session

    def __init__(self, config):
        super().__init__(config)
        if not config.disk_dir:
            raise ValueError("disk_dir: the disk transport needs a directory shared with the engines")
        self.root = Path(config.disk_dir)

    def open(self, engines: EngineSet) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.broken = False

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, engines: EngineSet) -> int:
        final = self.root / f"v{version}"
        if final.exists():  # published whole (atomic rename): a restarted engine catches up on it
            nbytes = sum(t.numel() * t.element_size() for _, t in named_tensors)  # runs the export
        else:
            nbytes = self._publish(named_tensors, version, final)
        if failed := engines.call(lambda e: e.update_weights_from_disk(str(final), str(version))):
            raise SyncError(
                f"update_weights_from_disk of {final} failed: {describe(failed)}", engine=next(iter(failed))
            )
        return nbytes

    def _publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, final: Path) -> int:

        self._remove_old(keep=version)
        tmp = Path(tempfile.mkdtemp(prefix=f".v{version}-", dir=self.root))
        nbytes, shard, shard_bytes, index = 0, {}, 0, 0
        try:
            for name, tensor in named_tensors:
                size = tensor.numel() * tensor.element_size()
                if shard and shard_bytes + size > self.config.bucket_bytes:
                    save_file(shard, tmp / f"model-{index:05d}.safetensors")
                    shard, shard_bytes, index = {}, 0, index + 1
                shard[name] = tensor.detach().contiguous().cpu()
                shard_bytes += size
                nbytes += size
            if shard:
                save_file(shard, tmp / f"model-{index:05d}.safetensors")
            os.rename(tmp, final)  # atomic publish
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return nbytes

    def _remove_old(self, keep: int) -> None:
        for path in self.root.glob("v*"):
            if path.is_dir() and path.name[1:].isdigit() and int(path.name[1:]) < keep:
                shutil.rmtree(path, ignore_errors=True)

    def close(self, engines: EngineSet) -> None:
        self.broken = True
