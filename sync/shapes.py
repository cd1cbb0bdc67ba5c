"""`make_syncer`: which `sync.syncer.Syncer` a trainer rank holds, picked once from the sync's setup.

    syncer = make_syncer(engines, SyncSetup(config, export_source_ranks(), version))  # every rank
    syncer.update(export, version)                                                    # every rank

The shape follows from the setup, in this order:
  1. adapters (`SyncSetup.adapters`): the sync source publishes them (`sync.lora.AdapterSync`),
     the other ranks are `Bystander`s;
  2. PP > 1 with `stage_groups`, or any relay (`sync.relay.relay_ranks`): per-stage groups
     (`sync.stages.StagedSync`);
  3. otherwise one group (`sync.pipeline.Funnel`): the plain sender (`sync.sender.WeightSender`)
     on the sync source, the other stages' tensors funnelled to it (with one stage, none).
Every full-weight shape is a `sync.syncer.ViaCoordinator`: its `sender` is the coordinator's.

Collective over the trainer world (relays are found by host name, and per-stage groups create
their control groups on every rank): every rank calls it with the same setup; `engines`
(endpoints to the same engines, in the same order) matter only where a rank sends.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from sync.config import AdapterSyncConfig, SyncConfig
from sync.engine_api import EngineEndpoint
from sync.lora import AdapterSync, AdapterWriter
from sync.pipeline import Funnel, sync_source
from sync.relay import relay_ranks
from sync.stages import StagedSync
from sync.syncer import Bystander, Syncer


@dataclass(frozen=True)
class SyncSetup:
    """What picks and builds a rank's `Syncer`; the same on every trainer rank."""

    config: SyncConfig
    """The `sync:` section (transport, bucket size, stage groups, relays)."""
    stage_sources: dict[int, int]
    """{pipeline stage: the global rank that exports it} (`parallel.export.export_source_ranks`)."""
    version: int = 0
    """The version the engines serve now."""
    adapters: AdapterSyncConfig | None = None
    """With LoRA: how adapters reach the engines (then only adapters move); None: full weights."""
    peft_config: dict | None = None
    """With LoRA: every version's PEFT `adapter_config` (`parallel.peft.adapter_config`)."""
    write_adapter: AdapterWriter | None = None
    """With LoRA's disk route: writes an adapter directory (`parallel.peft.write_adapter`)."""

    def __post_init__(self):
        if not self.stage_sources:
            raise ValueError("stage_sources: empty; pass parallel.export.export_source_ranks()")


def make_syncer(engines: list[EngineEndpoint], setup: SyncSetup) -> Syncer:
    """This rank's part in every weight update of `setup` (collective, see above)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    sources, config = setup.stage_sources, setup.config
    coordinator = rank == sync_source(sources)
    if setup.adapters is not None:
        if not coordinator:
            return Bystander()
        return AdapterSync(engines, setup.adapters, setup.write_adapter, setup.peft_config)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    relays = relay_ranks(config, sources) if world_size > 1 else {}
    if (len(sources) > 1 and config.stage_groups) or any(relays.values()):
        senders = engines if rank in sources.values() else []
        return StagedSync(senders, config, sources, setup.version, relays=relays)
    return Funnel(engines, config, sources, setup.version)
