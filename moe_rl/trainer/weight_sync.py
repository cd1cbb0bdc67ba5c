"""The trainer world's side of weight sync: which rank sends, to which engines, and the retry.

`WeightSync` lives on every trainer rank. `connect` finds each pipeline stage's export source
(`parallel.export.export_source_ranks`); the sync source builds the `sync.sender.WeightSender`
(full weights) or, with LoRA, rank 0 builds the `sync.lora.AdapterSync`. `sync` is collective:
every rank exports (the stages funnel their tensors to the sync source), the source streams them.
An engine that dies mid-sync is dropped and the version resent to the live ones (a fresh export)
until they commit; the ranks agree on each retry through `_agree`. The Ray actor
(`moe_rl.rl.trainer_group.TrainerRank`) only forwards calls here.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # megatron-core loads only where a trainer runs, not in the driver
    from moe_rl.trainer.megatron_trainer import MegatronTrainer


class WeightSync:
    def __init__(self, trainer: MegatronTrainer, rank: int, world_size: int):
        self.trainer, self.rank, self.world_size = trainer, rank, world_size
        self.sender = None  # the sync source's WeightSender (rank 0's AdapterSync with LoRA)
        self.sources: dict[int, int] = {}
        self.kind, self.fp8 = "embedded", None

    def connect(self, urls: list[str], sync_config, kind: str, version: int = 0, adapters=None) -> None:
        """Find each pipeline stage's export source; the sync source builds the WeightSender
        (the engines serve `version`), or with LoRA rank 0 the AdapterSync (`adapters`: its
        sync.lora.AdapterSyncConfig), and loads the adapter of `version`."""
        import dataclasses
        from urllib.parse import urlsplit

        from moe_rl.engine.client import EngineClient, engine_name
        from parallel.export import export_source_ranks
        from sync.group import address_for
        from sync.pipeline import sync_source
        from sync.sender import WeightSender

        self.sources, self.kind = export_source_ranks(), kind
        self.fp8 = fp8_format(sync_config.fp8_blocks)
        if adapters is not None:
            self._connect_adapters(urls, adapters, version)
            return
        if sync_config.master_address is None:  # engines on other nodes must reach this rank
            hosts = [urlsplit(url).hostname or "127.0.0.1" for url in urls]
            sync_config = dataclasses.replace(sync_config, master_address=address_for(hosts))
        if self.rank == sync_source(self.sources):
            # one retry: a dead engine is found (and dropped) in ~0.25 s instead of ~1.75 s
            clients = [EngineClient(url, kind=kind, name=engine_name(i), retries=1) for i, url in enumerate(urls)]
            self.sender = WeightSender(clients, sync_config, version)

    def _connect_adapters(self, urls: list[str], config, version: int) -> None:
        from moe_rl.engine.client import EngineClient, engine_name
        from parallel.peft import write_adapter
        from sync.lora import AdapterSync

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

    def sync(
        self,
        version: int,
        bucket_bytes: int,
        *,
        joined: dict[str, str] | None = None,
        served_version: int = 0,
        lost: list[str] = (),
    ) -> dict:
        """Stream the weights to the engines as `version` (collective: every rank calls it).

        `lost`: engines known dead, removed from the sender first. `joined`: restarted engines
        (name -> url, serving `served_version`) the sender takes back; with `version` = the
        committed one only they receive it (catch-up). An engine that dies mid-sync is dropped
        and the sync retried (a fresh export) until the live engines commit. Returns seconds,
        the engines that committed, and those dropped as dead."""
        from moe_rl.engine.client import EngineClient
        from sync.engine_set import SyncError
        from sync.pipeline import stage_stream
        from sync.sender import exhaust

        if self.trainer.lora is not None:
            return self._sync_adapters(version, joined or {}, lost)
        start, result, error = time.perf_counter(), {"engines": [], "dropped": []}, None
        if self.sender is not None:
            for name in lost:
                self.sender.remove(name)
            for name, url in (joined or {}).items():
                self.sender.add(EngineClient(url, kind=self.kind, name=name, retries=1), served_version)
        while self._agree(
            self.sender is not None and error is None and (version > self.sender.version or bool(self.sender.behind))
        ):
            stream = stage_stream(self.trainer.export_hf_weights(bucket_bytes), self.sources)
            if self.fp8 is not None:
                stream = self.fp8.quantize_stream(stream)
            if self.sender is None:
                exhaust(stream)
                continue
            try:
                stats = self.sender.update(stream, version)
                result["engines"], result["dropped"] = stats.engines, result["dropped"] + stats.dropped
            except SyncError as failure:  # retried while it was an engine dying, raised otherwise
                result["dropped"] += failure.dropped
                error = None if failure.dropped else failure
            except Exception as failure:  # noqa: BLE001 - raised below, once every rank left the loop
                error = failure
        if error is not None:
            raise error
        return {**result, "seconds": time.perf_counter() - start}

    def _sync_adapters(self, version: int, joined: dict[str, str], lost) -> dict:
        """LoRA: the new version's adapter to every engine (no pause); a restarted engine loads the
        kept versions instead (a catch-up: `version` is the one already loaded)."""
        from moe_rl.engine.client import EngineClient
        from sync.engine_set import SyncError

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
        import torch.distributed as dist

        from sync.pipeline import sync_source

        if self.world_size == 1:
            return decision
        box = [decision]
        dist.broadcast_object_list(box, src=sync_source(self.sources))
        return bool(box[0])

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()


def fp8_format(blocks: int | None):
    """sync.fp8_blocks as the export's FP8 format (None: full precision)."""
    from parallel.fp8 import BlockFP8

    return None if blocks is None else BlockFP8(blocks, blocks)
