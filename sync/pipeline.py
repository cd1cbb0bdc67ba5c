"""Pipeline parallelism: every stage's exported tensors reach the one sync source rank (a funnel).

With PP > 1, the streaming export yields each stage's layers on that stage's own source rank
(TP0/DP0 of the stage). `stage_stream` funnels them to the sync source, the source of the first
stage (the rank that owns the `WeightSender` and is rank 0 of the weight-update group): there
it yields its own stage's tensors, then every other stage's in stage order, received
point-to-point over the trainer's default world (`torch.distributed`, gloo or NCCL); each
other stage's source sends its tensors there as its export yields them; every other rank only
runs the export. The sender then packs and broadcasts them like any single-stage stream.

The default is one weight-update group per stage instead (`sync.stages`, `SyncConfig.stage_groups`):
each stage's source broadcasts its own layers, so no tensor crosses the trainer network only to
reach another trainer rank. The funnel (`stage_groups: false`) keeps one group, and costs: (PP-1)/PP
of the bytes cross the trainer network once more, into the sync source's one NIC, as one message
and a pickled header per tensor; that receive overlaps the broadcast of the previous bucket.

`Funnel` is this shape as a `sync.syncer.Syncer` (with one stage: the plain sender).

Collective contract: every rank of the trainer world calls `stage_stream` with its own export
generator and iterates the result to the end (`WeightSender.update` on the sync source,
`sync.sender.exhaust` elsewhere; `Funnel.update` does both). Stage sources other than the first
block in their sends until the sync source reaches their stage (bounded by the default group's
timeout). Memory on the sync source: one received tensor at a time, on top of the sender's two
buckets.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch
import torch.distributed as dist

from sync import traffic
from sync.bucket import dtype_from_name, dtype_name
from sync.config import SyncConfig, SyncStats
from sync.engine_api import EngineEndpoint
from sync.owner import Decision, DiffOwner, announce
from sync.sender import WeightSender
from sync.syncer import Export, ViaCoordinator
from sync.transports.base import exhaust


def stage_stream(
    named_tensors: Iterable[tuple[str, torch.Tensor]], stage_sources: dict[int, int]
) -> Iterator[tuple[str, torch.Tensor]]:
    """All trainer ranks. `stage_sources` = {pipeline stage: global rank that yields its
    tensors} (`parallel.export.export_source_ranks()`); yields every stage's tensors on the
    sync source (the first stage's source), nothing elsewhere."""
    if not stage_sources:
        raise ValueError("stage_sources: empty; pass parallel.export.export_source_ranks()")
    rank = dist.get_rank()
    stages = sorted(stage_sources)
    sync_source = stage_sources[stages[0]]
    if rank == sync_source:
        yield from named_tensors
        for stage in stages[1:]:
            yield from _receive(stage_sources[stage])
    elif rank in stage_sources.values():
        _send(named_tensors, sync_source)
    else:
        for _ in named_tensors:  # this rank's share of the export's collectives
            pass


class Funnel(ViaCoordinator):
    """A trainer rank's part in one weight-update group for every stage: the sync source sends
    every stage's tensors through its `WeightSender` (`engines` matter there only), every other
    rank feeds `stage_stream`. With one pipeline stage nothing funnels: the plain sender."""

    def __init__(self, engines: list[EngineEndpoint], config: SyncConfig, stage_sources: dict[int, int], version: int):
        self.stage_sources = stage_sources
        # owner-side diffs (`sync.owner`) with one stage only: funnelled tensors would
        # reach the sender without their owners' marks, so with PP > 1 they go dense to the source
        self.owner = DiffOwner() if config.delta.enabled and len(stage_sources) == 1 else None
        if dist.get_rank() == sync_source(stage_sources):
            self.sender = WeightSender(engines, config, version)
            if self.owner is not None:
                self.sender.owners, self.sender.owned = self._begin, self.owner.arrived

    def update(self, export: Export, version: int) -> SyncStats | None:
        if self.owner is not None:
            export = self.owner.follow(export)
        stream = stage_stream(export, self.stage_sources)
        if self.sender is None:
            self._begin(None)  # the coordinator's decision arrives here
            exhaust(stream)  # this rank's sends, or its share of the export's collectives
            return None
        return self.sender.update(stream, version)

    def _begin(self, decision: Decision | None) -> None:
        if self.owner is not None:
            self.owner.begin(announce(decision, sync_source(self.stage_sources)))


def sync_source(stage_sources: dict[int, int]) -> int:
    """The global rank that owns the sender: the first pipeline stage's source."""
    return stage_sources[min(stage_sources)]


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _send(named_tensors: Iterable[tuple[str, torch.Tensor]], dst: int) -> None:
    device = _device()
    for name, tensor in named_tensors:
        header = [(name, dtype_name(tensor.dtype), tuple(tensor.shape))]
        dist.send_object_list(header, dst=dst, device=device)
        dist.send(tensor.detach().contiguous().to(device), dst=dst)
        traffic.count("funnel", sent=tensor.numel() * tensor.element_size())
    dist.send_object_list([None], dst=dst, device=device)  # end of this stage


def _receive(src: int) -> Iterator[tuple[str, torch.Tensor]]:
    device = _device()
    while True:
        header = [None]
        dist.recv_object_list(header, src=src, device=device)
        if header[0] is None:
            return
        name, dtype, shape = header[0]
        tensor = torch.empty(shape, dtype=dtype_from_name(dtype), device=device)
        dist.recv(tensor, src=src)
        traffic.count("funnel", received=tensor.numel() * tensor.element_size())
        yield name, tensor
