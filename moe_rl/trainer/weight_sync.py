"""The trainer world's side of weight sync: which rank sends, to which engines, and the retry.

`WeightSync` lives on every trainer rank. `connect` finds each pipeline stage's export source
(`parallel.export.export_source_ranks`); the sync source builds the `sync.sender.WeightSender`
(full weights) or, with LoRA, rank 0 builds the `sync.lora.AdapterSync`. `sync` is collective:
every rank exports, FP8 blocks (`sync.fp8_blocks`) quantized where each weight lives; with
pipeline parallelism each stage's source broadcasts its own layers over its own group, the sync
source coordinating (`sync.stages.StagedSync`), or with `sync.stage_groups: false` the stages
funnel their tensors to the sync source (`sync.pipeline`), which streams them all.
An engine that dies mid-sync is dropped and the version resent to the live ones (a fresh export)
until they commit; the ranks agree on each retry through `_agree`.

Each call takes one request (`ConnectRequest`, `SyncRequest`), built once by the driver
(`moe_rl.rl.cluster.RLCluster`) and passed unchanged through `TrainerGroup` and every rank's Ray
actor (`moe_rl.rl.trainer_group.TrainerRank`), which only forward it here.
"""

from __future__ import annotations

import dataclasses
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping
from urllib.parse import urlsplit

import torch.distributed as dist

from moe_rl.engine.client import EngineClient, engine_name
from parallel.export import export_source_ranks
from parallel.fp8 import BlockFP8
from parallel.peft import write_adapter
from sync.config import AdapterSyncConfig, SyncConfig
from sync.engine_set import SyncError
from sync.group import address_for
from sync.lora import AdapterSync
from sync.pipeline import stage_stream, sync_source
from sync.sender import WeightSender, exhaust
from sync.stages import StagedSync

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


@dataclass(frozen=True)
class SyncRequest:
    """`WeightSync.sync`: one weight update, or a catch-up of restarted engines."""

    version: int
    """The version to commit; the committed one again: only the engines behind receive it."""
    bucket_bytes: int
    """The export's gather bucket (`sync.bucket_bytes`)."""
    joined: Mapping[str, str] = field(default_factory=dict)
    """Restarted engines (name -> url) the sender takes back first."""
    served_version: int = 0
    """The version the `joined` engines serve (what they were restarted from)."""
    lost: tuple[str, ...] = ()
    """Engines known dead, removed from the sender first."""


class WeightSync:
    def __init__(self, trainer: MegatronTrainer, rank: int, world_size: int):
        self.trainer, self.rank, self.world_size = trainer, rank, world_size
        self.sender = None  # the sync source's WeightSender (rank 0's AdapterSync with LoRA)
        self.staged: StagedSync | None = None  # PP > 1 with stage groups: every rank's part
        self.sources: dict[int, int] = {}
        self.kind, self.fp8 = "embedded", None

    def connect(self, request: ConnectRequest) -> None:
        """Find each pipeline stage's export source; the sync source builds the WeightSender
        (the engines serve `request.version`), or with LoRA rank 0 the AdapterSync
        (`request.adapters`), and loads the adapter of that version. Collective."""
        urls, sync_config, version = list(request.urls), request.sync, request.version
        self.sources, self.kind = export_source_ranks(), request.kind
        self.fp8 = fp8_format(sync_config.fp8_blocks)
        if request.adapters is not None:
            self._connect_adapters(urls, request.adapters, version)
            return
        if sync_config.master_address is None:  # engines on other nodes must reach this rank
            hosts = [urlsplit(url).hostname or "127.0.0.1" for url in urls]
            sync_config = dataclasses.replace(sync_config, master_address=address_for(hosts))
        # one retry: a dead engine is found (and dropped) in ~0.25 s instead of ~1.75 s
        clients = [EngineClient(url, kind=self.kind, name=engine_name(i), retries=1) for i, url in enumerate(urls)]
        relays = relay_ranks(sync_config, self.sources) if self.world_size > 1 else {}
        if (len(self.sources) > 1 and sync_config.stage_groups) or any(relays.values()):
            # every stage source sends its own layers, its node-mates relaying
            mine = clients if self.rank in self.sources.values() else []
            self.staged = StagedSync(mine, sync_config, self.sources, version, relays=relays)
            self.sender = self.staged.sender
        elif self.rank == sync_source(self.sources):
            self.sender = WeightSender(clients, sync_config, version)

    def _connect_adapters(self, urls: list[str], config, version: int) -> None:

        if self.rank == 0:
            clients = [EngineClient(url, kind=self.kind, name=engine_name(i), retries=1) for i, url in enumerate(urls)]
            self.sender = AdapterSync(clients, config, write_adapter)
        self._publish_adapter(version)

    def _publish_adapter(self, version: int) -> dict:
        """Collect the adapters on rank 0 and load them as `policy-v{version}` (collective)."""
        collected = self.trainer.export_adapter()
        if collected is None:
            return {"engines": [], "dropped": []}
        stats = self.sender.publish(version, *collected)
        return {"engines": stats.engines, "dropped": stats.dropped, "bytes": stats.bytes}

    def sync(self, request: SyncRequest) -> dict:
        """Stream the weights to the engines as `request.version` (collective: every rank calls it).

        `request.lost` are removed from the sender first, `request.joined` taken back (serving
        `request.served_version`); with the committed version only they receive it (catch-up).
        An engine that dies mid-sync is dropped and the sync retried (a fresh export) until the
        live engines commit. Returns seconds, the engines that committed, and those dropped as dead."""
        version = request.version
        if self.trainer.lora is not None:
            return self._sync_adapters(version, request.joined, request.lost)
        start, result, error = time.perf_counter(), {"engines": [], "dropped": []}, None
        members = self.staged or self.sender  # with stage groups, every stage source keeps the members
        if members is not None:
            for name in request.lost:
                members.remove(name)
            for name, url in request.joined.items():
                members.add(EngineClient(url, kind=self.kind, name=name, retries=1), request.served_version)
        while self._agree(
            self.sender is not None and error is None and (version > self.sender.version or bool(self.sender.behind))
        ):
            export = self.trainer.export_hf_weights(request.bucket_bytes, fp8=self.fp8)
            if self.staged is not None:  # stage sources serve their turns, the coordinator sends
                update = self.staged.update
            else:
                export = stage_stream(export, self.sources)
                update = self.sender.update if self.sender is not None else lambda stream, _: exhaust(stream)
            if self.sender is None:
                update(export, version)
                continue
            try:
                stats = update(export, version)
                result["engines"], result["dropped"] = stats.engines, result["dropped"] + stats.dropped
            except SyncError as failure:  # retried while it was an engine dying, raised otherwise
                result["dropped"] += failure.dropped
                error = None if failure.dropped else failure
            except Exception as failure:  # noqa: BLE001 - raised below, once every rank left the loop
                error = failure
        if error is not None:
            raise error
        return {**result, "seconds": time.perf_counter() - start}

    def _sync_adapters(self, version: int, joined: Mapping[str, str], lost: tuple[str, ...]) -> dict:
        """LoRA: the new version's adapter to every engine (no pause); a restarted engine loads the
        kept versions instead (a catch-up: `version` is the one already loaded)."""
        start, dropped = time.perf_counter(), []
        if self.sender is not None:  # rank 0 only: the other ranks hold no sender
            for name in lost:
                self.sender.remove(name)
            for name, url in joined.items():
                try:
                    self.sender.add(EngineClient(url, kind=self.kind, name=name, retries=1))
                except SyncError:  # it died again: restarted next time (raising here would strand the ranks)
                    dropped.append(name)
        caught_up = self._agree(self.sender is not None and self.sender.version == version)
        result = {"engines": [], "dropped": []} if caught_up else self._publish_adapter(version)
        return {**result, "dropped": result["dropped"] + dropped, "seconds": time.perf_counter() - start}

    def _agree(self, decision: bool) -> bool:
        """The sync source's `decision`, on every rank (a collective over the trainer world)."""
        if self.world_size == 1:
            return decision
        box = [decision]
        dist.broadcast_object_list(box, src=sync_source(self.sources))
        return bool(box[0])

    def close(self) -> None:
        if self.staged is not None:
            self.staged.close()
        elif self.sender is not None:
            self.sender.close()


def relay_ranks(config: SyncConfig, sources: dict[int, int]) -> dict[int, list[int]]:
    """{stage: the trainer ranks on its source's node that join its group as relays}
    (`sync.relays`; None: every node-mate with nccl, none with gloo). Collective."""
    hosts: list = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    taken, relays = set(sources.values()), {}
    for stage, source in sorted(sources.items()):
        mates = [r for r, host in enumerate(hosts) if host == hosts[source] and r not in taken]
        count = config.relays if config.relays is not None else (len(mates) if config.backend == "nccl" else 0)
        relays[stage] = mates[:count]
        taken |= set(relays[stage])
    return relays


def fp8_format(blocks: int | None):
    """sync.fp8_blocks as the export's FP8 format (None: full precision)."""
    return None if blocks is None else BlockFP8(blocks, blocks)
