"""Adapter-only sync: each policy version is a new LoRA adapter on every engine, without a pause.

    adapters = AdapterSync(engines, AdapterSyncConfig(route="disk", directory=..., keep=2), write_adapter)
    adapters.publish(version, adapter_config, tensors)   # rank 0 of the trainer (parallel.peft)

As the adapter shape of `sync.syncer.Syncer` (built with `peft_config`, every version's
`adapter_config.json`), `update(named_tensors, version)` publishes the adapter's PEFT tensors.

Version N is the adapter `policy-v{N}` (`adapter_name`), served next to the older ones; the base
weights never change. `publish` is the update, as numbered steps:
  1. versions only increase;
  2. disk route: write `<directory>/.tmp-policy-v{N}`, rename it to `<directory>/policy-v{N}`
     (engines never see a half-written adapter); tensors route: nothing on disk;
  3. load it on every engine at once (`/load_lora_adapter`, or `/load_lora_adapter_from_tensors`
     with per-tensor checksums): all or nothing. If an engine refuses, the adapter is unloaded
     from the engines that accepted it and SyncError names the engine; an engine that does not
     answer `/health` afterwards is dead: dropped (`SyncStats.dropped`) and the others commit;
  4. keep `keep` versions (max_staleness + 1): the oldest beyond them is unloaded in the
     background. SGLang's unload waits for the requests still using it, so the loop never waits
     for it; requests in flight finish on the adapter they started with, new ones name the newest;
  5. delete the directories of versions whose unload finished on every engine, at the earliest
     one sync after it was issued: no file goes while an engine may still read it.
Names stay unique across a resume, since versions continue from the run checkpoint's step.
Restarted engines: `add(engine)` loads the versions still kept (the files, or the tensors kept
in memory), so its requests can name any of them.
"""

from __future__ import annotations

import shutil
import time
from collections import deque
from concurrent.futures import Future
from pathlib import Path
from typing import Callable, Protocol

import torch

from sync.config import AdapterSyncConfig, SyncStats
from sync.engine_set import EngineSet, SyncError, describe, require_health
from sync.syncer import Export, Syncer


def adapter_name(version: int) -> str:
    """The engines' name of the policy's adapter at `version`: what requests put in `lora_path`."""
    return f"policy-v{version}"


class AdapterEndpoint(Protocol):
    """What the adapter sync needs of an engine (moe_rl.engine.client.EngineClient has it)."""

    name: str

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> None: ...

    async def load_lora_adapter_from_tensors(
        self, lora_name: str, config_dict: dict, named_tensors: dict[str, torch.Tensor], tp_size: int = 1
    ) -> None: ...

    async def unload_lora_adapter(self, lora_name: str) -> None: ...

    async def num_group_ranks(self) -> int: ...

    async def health(self) -> bool: ...


AdapterWriter = Callable[[Path, dict, dict[str, torch.Tensor]], Path]
"""Writes a PEFT adapter directory atomically and returns it (`parallel.peft.write_adapter`; the
caller passes it, since `sync` does not import `parallel`)."""


class AdapterSync(Syncer):
    def __init__(
        self,
        engines: list[AdapterEndpoint],
        config: AdapterSyncConfig,
        write: AdapterWriter | None = None,
        peft_config: dict | None = None,
    ):
        """`peft_config`: the PEFT `adapter_config` of every version, what `update` publishes with
        (`publish` takes its own)."""
        if not engines:
            raise ValueError("engines: need at least one engine to load adapters on")
        if config.route == "disk" and write is None:
            raise ValueError("the disk adapter route needs `write` (parallel.peft.write_adapter)")
        self.config, self._write_adapter, self.peft_config = config, write, peft_config
        self.engines = EngineSet(engines, config.timeout_s)
        self.loaded: deque[int] = deque()  # versions loaded on every engine, oldest first
        self._kept: dict[int, tuple[dict, dict[str, torch.Tensor]]] = {}  # tensors route: for restarts
        self._unloading: dict[int, list[Future]] = {}  # version -> its background unloads

    @property
    def version(self) -> int | None:
        """The newest version loaded on every engine (None before the first)."""
        return self.loaded[-1] if self.loaded else None

    # -- the update ------------------------------------------------------------------------------

    def pending(self, version: int) -> bool:
        return self.version is None or version > self.version

    def update(self, export: Export, version: int) -> SyncStats:
        """`publish(version, peft_config, tensors)` of the adapter's `(PEFT name, tensor)` pairs."""
        if self.peft_config is None:
            raise RuntimeError("AdapterSync.update needs the peft_config it was built with; or call publish")
        return self.publish(version, self.peft_config, dict(export))

    def publish(self, version: int, config: dict, tensors: dict[str, torch.Tensor]) -> SyncStats:
        start = time.perf_counter()
        # 1. versions only increase
        if self.version is not None and version <= self.version:
            raise ValueError(f"version: {version} is not newer than the loaded {self.version}")
        # 2. the disk route publishes the directory atomically
        path = self._write_adapter(self._path(version), config, tensors) if self.config.route == "disk" else None
        # 3. load everywhere, all or nothing
        name = adapter_name(version)
        failed = self.engines.call(lambda engine: self._load(engine, version, config, tensors, path))
        dropped = sorted(self.engines.subset(set(failed)).call(require_health))
        self.engines.drop(set(dropped))
        refused = {n: error for n, error in failed.items() if n not in dropped}
        if refused or not self.engines.engines:
            self.engines.subset(set(self.engines.names) - set(failed)).call(
                lambda engine: engine.unload_lora_adapter(name)
            )
            if path is not None:
                shutil.rmtree(path, ignore_errors=True)
            error = SyncError(
                f"adapter {name}: {describe(refused) if refused else 'every engine is dead'}; no engine serves it",
                engine=next(iter(refused), None),
            )
            error.dropped = dropped
            raise error
        self.loaded.append(version)
        if self.config.route == "tensors":
            self._kept[version] = (config, tensors)
        # 5. (before 4: only unloads an earlier publish issued may have finished)
        self._delete_unloaded()
        # 4. unload what is older than `keep` versions, without waiting for it
        while len(self.loaded) > self.config.keep:
            self._unload(self.loaded.popleft())
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        return SyncStats(version, size, time.perf_counter() - start, engines=self.engines.names, dropped=dropped)

    def add(self, engine: AdapterEndpoint, served_version: int = 0) -> None:
        """A restarted engine (no adapters; its base weights never change, whatever `served_version`)
        joins: it loads every kept version, oldest first; SyncError (and it stays out) if it cannot."""
        self.engines.add(engine)
        one = self.engines.subset({engine.name})
        for version in self.loaded:
            config, tensors = self._kept.get(version, ({}, {}))
            path = self._path(version) if self.config.route == "disk" else None
            if failed := one.call(lambda e: self._load(e, version, config, tensors, path)):
                self.engines.drop({engine.name})
                raise SyncError(
                    f"restarted {engine.name} could not load {adapter_name(version)}: {describe(failed)}",
                    engine=engine.name,
                )

    def remove(self, name: str) -> None:
        """Forget a member the orchestrator knows is dead."""
        self.engines.drop({name})

    def close(self) -> None:
        self.engines.close()

    # -- pieces ------------------------------------------------------------------------------------

    def _path(self, version: int) -> Path:
        return Path(self.config.directory) / adapter_name(version)

    async def _load(self, engine, version: int, config: dict, tensors: dict, path: Path | None) -> None:
        if path is not None:
            await engine.load_lora_adapter(adapter_name(version), str(path))
        else:
            tp_size = await engine.num_group_ranks()
            await engine.load_lora_adapter_from_tensors(adapter_name(version), config, tensors, tp_size=tp_size)

    def _unload(self, version: int) -> None:
        self._kept.pop(version, None)
        self._unloading[version] = list(
            self.engines.submit(lambda engine: engine.unload_lora_adapter(adapter_name(version))).values()
        )

    def _delete_unloaded(self) -> None:
        for version, futures in list(self._unloading.items()):
            if all(future.done() for future in futures):
                del self._unloading[version]
                if self.config.route == "disk":
                    shutil.rmtree(self._path(version), ignore_errors=True)
