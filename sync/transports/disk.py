"""Disk transport: versions published on storage shared with the engines (no NCCL between the jobs).

`send` writes the stream as one version directory, `disk_dir/v{version}` (`sync.published`: a
hidden temporary directory renamed at the end, so an engine never sees a half-written version),
then tells every engine, concurrently, through `update_weights_from_disk(model_path,
weight_version)`. A full version is safetensors shards of at most `bucket_bytes`, as any HF loader
reads them; with `sync.delta` the stream is payloads (`sync.delta`), written as zstd-compressed
delta files that name their base version, and an engine resolves the chain from what it holds, or
from the last anchor (`sync.published.resolve`). Once a version is published, older ones are
pruned: the newest anchor and the deltas after it stay. Sending a version that is already published (the
sender catching a restarted engine up to the committed version) writes nothing: the export is
exhausted and the engines load the published directory, a delta's chain included.

Memory on the source rank: one shard (the tensors of at most `bucket_bytes`, held until written).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch

from sync import published
from sync.engine_set import EngineSet, SyncError, describe
from sync.transports.base import Transport


class DiskTransport(Transport):
    name = "disk"
    session = False  # SGLang's /update_weights_from_disk loads outside a session
    carries_deltas = True

    def __init__(self, config):
        super().__init__(config)
        if not config.disk_dir:
            raise ValueError("disk_dir: the disk transport needs a directory shared with the engines")
        self.root = Path(config.disk_dir)

    def open(self, engines: EngineSet) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.broken = False

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, engines: EngineSet) -> int:
        final = published.version_dir(self.root, version)
        if final.exists():  # published whole (atomic rename): a restarted engine catches up on it
            nbytes = sum(t.numel() * t.element_size() for _, t in named_tensors)  # runs the export
        else:
            nbytes = published.publish(self.root, named_tensors, version, self.config.bucket_bytes, self.delta)
            published.prune(self.root)
        if failed := engines.call(lambda e: e.update_weights_from_disk(str(final), str(version))):
            raise SyncError(
                f"update_weights_from_disk of {final} failed: {describe(failed)}", engine=next(iter(failed))
            )
        return nbytes

    def close(self, engines: EngineSet) -> None:
        self.broken = True
