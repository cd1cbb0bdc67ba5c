"""The trainer world's side of weight sync: every rank's `sync.syncer.Syncer`, the export it feeds,
and the retry.

`WeightSync` lives on every trainer rank. `connect` finds each pipeline stage's export source
(`parallel.export.export_source_ranks`) and builds this rank's Syncer (`sync.shapes.make_syncer`
picks the shape: per-stage groups, the funnel, the plain sender, or with LoRA the adapters).
`sync` is collective and is one loop whatever the shape: every rank exports (the weights, FP8
blocks (`sync.fp8_blocks`) quantized where each weight lives; with LoRA the adapters) and calls
`Syncer.update`, as long as the sync source says that engines still need the version. An engine
that dies mid-sync is dropped and the version resent to the live ones (a fresh export) until
they commit; the ranks agree on each retry through `_agree`.

Each call takes one request (`ConnectRequest`, `SyncRequest`), built once by the driver
(`moe_rl.rl.cluster.RLCluster`) and passed unchanged through `TrainerGroup` and every rank's Ray
actor (`moe_rl.rl.trainer_group.TrainerRank`), which only forward it here.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping
from urllib.parse import urlsplit

import torch.distributed as dist

from moe_rl.engine.client import EngineClient, engine_name
from moe_rl.trace import TRACER
from parallel.export import export_source_ranks
from parallel.fp8 import BlockFP8
from parallel.peft import adapter_config, hf_lora_targets, write_adapter
from sync.config import AdapterSyncConfig, SyncConfig
from sync.engine_set import SyncError
from sync.group import address_for
from sync.pipeline import sync_source
from sync.shapes import SyncSetup, make_syncer
from sync.syncer import Bystander, Export, Syncer

if TYPE_CHECKING:  # megatron-core loads only where a trainer runs, not in the driver
    from moe_rl.trainer.megatron_trainer import MegatronTrainer


@dataclass(frozen=True)
class ConnectRequest:
    """`WeightSync.connect`: the engines to sync to and how."""

    urls: tuple[str, ...]
    """The engines' base URLs, in engine order (`engine_name(i)` names the i-th)."""
    sync: SyncConfig
    """The run's `sync:` section (transport, bucket size, pause mode, FP8)."""
    kind: str
    """The engines' `engines.kind` ("embedded" or "sglang")."""
    version: int = 0
    """The version the engines serve now (0, or the run checkpoint's on a resume)."""
    adapters: AdapterSyncConfig | None = None
    """With LoRA: how adapters reach the engines (then only adapters move); None: full weights."""
    kept: bool = False
    """The engines kept running while the trainer restarted from a run checkpoint: they serve the
    run's later versions (or part of one), which it discarded; `version` is sent to them at once."""


@dataclass(frozen=True)
class SyncRequest:
    """`WeightSync.sync`: one weight update, or a catch-up of restarted or new engines."""

    version: int
    """The version to commit; the committed one again: only the engines behind receive it."""
    bucket_bytes: int
    """The export's gather bucket (`sync.bucket_bytes`)."""
    joined: Mapping[str, str] = field(default_factory=dict)
    """Restarted or new engines (name -> url; new: `moe-rl engines add`, `moe_rl.rl.fleet`) the sender
    takes in first."""
    served_version: int = 0
    """The version the `joined` engines serve (what they were restarted from)."""
    lost: tuple[str, ...] = ()
    """Engines known dead, or taken out of the fleet (`moe-rl engines remove`), removed from the sender first."""


@dataclass(frozen=True)
class SyncResult:
    """What `WeightSync.sync` did (the sync source's account; every rank returns it)."""

    engines: list[str]
    """The engines that committed the version (empty when none needed it)."""
    dropped: list[str]
    """Engines found dead and dropped on the way (the driver restarts them)."""
    seconds: float
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    """With `sync.delta`, of the update that committed (the sync source's own stage):
    `delta/anchor` (1: a full version), `delta/changed_fraction`, `delta/wire_fraction` (bytes sent
    over the tensors' own bytes) and `delta/wire_bytes` (every stage's)."""


class WeightSync:
    def __init__(self, trainer: MegatronTrainer, rank: int, world_size: int):
        self.trainer, self.rank, self.world_size = trainer, rank, world_size
        self.syncer: Syncer = Bystander()  # until `connect`
        self.sources: dict[int, int] = {0: 0}
        self.kind, self.fp8 = "embedded", None

    def connect(self, request: ConnectRequest) -> None:
        """Build this rank's Syncer for the engines (they serve `request.version`, or, kept across a
        trainer restart, are sent it now); with LoRA the adapter of that version is loaded on them
        at once. Collective."""
        self.sources, self.kind = export_source_ranks(), request.kind
        self.fp8 = fp8_format(request.sync.fp8_blocks)
        sync_config = request.sync
        if sync_config.master_address is None:  # engines on other nodes must reach this rank
            hosts = [urlsplit(url).hostname or "127.0.0.1" for url in request.urls]
            sync_config = dataclasses.replace(sync_config, master_address=address_for(hosts))
        setup = SyncSetup(sync_config, self.sources, request.version, request.adapters)
        if request.adapters is not None:
            lora = self.trainer.lora
            peft = adapter_config(lora, hf_lora_targets(self.trainer.bridge, lora.targets))
            setup = dataclasses.replace(setup, peft_config=peft, write_adapter=write_adapter)
        clients = [self._client(engine_name(i), url) for i, url in enumerate(request.urls)]
        self.syncer = make_syncer(clients, setup)
        if request.kept:  # behind whatever they serve: the first commit over the new group rolls them back
            for client in clients:
                self.syncer.add(client, None)
        self._converge(request.version, sync_config.bucket_bytes)  # adapters: `policy-v{version}`

    def sync(self, request: SyncRequest) -> SyncResult:
        """Move `request.version` to the engines (collective: every rank calls it).

        `request.lost` are removed first, `request.joined` taken back (serving
        `request.served_version`); with the committed version only the engines behind receive it
        (a catch-up). An engine that dies mid-sync is dropped and the update retried (a fresh
        export) until the live engines commit."""
        start, dropped = time.perf_counter(), []
        for name in request.lost:
            self.syncer.remove(name)
        for name, url in request.joined.items():
            try:
                self.syncer.add(self._client(name, url), request.served_version)
            except SyncError:  # it died again: restarted next time (raising here would strand the ranks)
                dropped.append(name)
        with TRACER.span("weight sync", version=request.version):
            engines, more, metrics = self._converge(request.version, request.bucket_bytes)
        return SyncResult(engines, dropped + more, time.perf_counter() - start, metrics)

    def _converge(self, version: int, bucket_bytes: int) -> tuple[list[str], list[str], dict[str, float]]:
        """Update until the engines hold `version`: (engines that committed, engines dropped, the
        committed update's delta metrics)."""
        engines, dropped, error, metrics = [], [], None, {}
        while self._agree(error is None and self.syncer.pending(version)):
            try:
                stats = self.syncer.update(self._export(bucket_bytes), version)
            except SyncError as failure:  # retried while it was an engine dying, raised otherwise
                dropped += failure.dropped
                error = None if failure.dropped else failure
            except Exception as failure:  # noqa: BLE001 - raised below, once every rank left the loop
                error = failure
            else:
                if stats is not None:
                    engines, dropped = stats.engines, dropped + stats.dropped
                    for phase, start, end in stats.phases:
                        TRACER.add(f"sync {phase}", start, end, lane="weight sync phases")
                    if stats.delta is not None:
                        metrics = {
                            "delta/anchor": float(stats.delta.anchor),
                            "delta/changed_fraction": stats.delta.changed_fraction,
                            "delta/wire_fraction": stats.delta.wire_fraction,
                            "delta/wire_bytes": float(stats.bytes),
                        }
        if error is not None:
            raise error
        return engines, dropped, metrics

    def _export(self, bucket_bytes: int) -> Export:
        """What this rank feeds its Syncer (collective): the policy's trained tensors, i.e. the
        adapters with LoRA (on rank 0; gathered at once), else the weights' stream."""
        if self.trainer.lora is not None:
            collected = self.trainer.export_adapter()
            return collected[1].items() if collected is not None else ()
        return self.trainer.export_hf_weights(bucket_bytes, fp8=self.fp8, owner=self.syncer.owner)

    def _client(self, name: str, url: str) -> EngineClient:
        # one retry: a dead engine is found (and dropped) in ~0.25 s instead of ~1.75 s
        return EngineClient(url, kind=self.kind, name=name, retries=1)

    def _agree(self, decision: bool) -> bool:
        """The sync source's `decision`, on every rank (a collective over the trainer world)."""
        if self.world_size == 1:
            return decision
        box = [decision]
        dist.broadcast_object_list(box, src=sync_source(self.sources))
        return bool(box[0])

    def close(self) -> None:
        self.syncer.close()


def fp8_format(blocks: int | None):
    """sync.fp8_blocks as the export's FP8 format (None: full precision)."""
    return None if blocks is None else BlockFP8(blocks, blocks)
