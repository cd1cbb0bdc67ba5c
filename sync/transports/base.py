"""The transport interface (sender side) and its lazy registry.

Lifecycle, called by `WeightSender` on the trainer's source rank only:

    open(engines)                     once, or again after a failure tore things down
    send(named_tensors, version, engines) -> bytes sent; engines acknowledged every piece
    close(engines)                    release groups, buffers, files

`send` moves the bytes and announces them, but never commits: the sender commits the version
(`update_weight_version`) only after `send` returned. `send` raises `SyncError` naming the
engine and bucket on any failure, after exhausting `named_tensors` (the export is a collective
on the trainer ranks: the source must keep iterating in lockstep even when it stops sending).
`broken` tells the sender that `open` must run again before the next `send`.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Iterable

import torch

from sync.engine_set import EngineSet


def exhaust(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Run an export to its end, keeping nothing: what every trainer rank that does not send it
    (or stopped sending it) does, so the export's collectives stay in lockstep on every rank."""
    for _ in named_tensors:
        pass


_REGISTRY = {
    "broadcast": "sync.transports.broadcast:BroadcastTransport",
    "disk": "sync.transports.disk:DiskTransport",
    "cuda_ipc": "sync.transports.cuda_ipc:CudaIpcTransport",
}


@dataclass(kw_only=True)
class TransportConfig:
    bucket_bytes: int = 512 << 20
    """Upper bound of one bucket (a larger tensor travels alone). GPU: 512 MiB-1 GiB."""
    backend: str | None = None
    """Process-group backend for `broadcast`: "gloo" | "nccl"; None = nccl with CUDA, else gloo."""
    master_address: str | None = None
    """Address of the trainer source rank, reachable from every engine. None: loopback when every
    engine runs on the source's host, else the source's address on the route to the engines
    (`sync.group.address_for`; the RL job resolves it from the engine URLs)."""
    master_port: int = 0
    """Rendezvous port on the source rank; 0 picks a free one."""
    group_name: str = "weight_update_group"
    """Name of the weight-update group (SGLang's `group_name`)."""
    timeout_s: float = 300.0
    """Bound on each collective and each engine call."""
    disk_dir: str | None = None
    """`disk`: directory on storage shared with the engines; versions appear as `v{N}/`."""

    def __post_init__(self):
        if self.bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes: must be positive, got {self.bucket_bytes}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s: must be positive, got {self.timeout_s}")
        if self.backend is None:
            self.backend = "nccl" if torch.cuda.is_available() else "gloo"

    @property
    def address(self) -> str:
        return self.master_address or "127.0.0.1"


class Transport(ABC):
    name: ClassVar[str]
    session: ClassVar[bool]
    """True if the engine loads this transport's pieces in place, inside SGLang's
    `/begin_weight_update` ... `/end_weight_update` session (the sender opens and closes it)."""
    broken: bool = True  # nothing opened yet
    carries_deltas: ClassVar[bool] = False
    """True if `send` can announce its pieces as `sync.delta` payloads (`delta`)."""
    delta: bool = False
    """Set by the sender before `send`: the stream is payloads (`sync.delta.DELTA_LOAD_FORMAT`)."""

    def __init__(self, config: TransportConfig):
        self.config = config

    def takes_deltas(self, engines: EngineSet) -> bool:
        """Whether a version may go to `engines` as `sync.delta` payloads over this transport."""
        return self.carries_deltas and all(engine.applies_deltas for engine in engines.engines)

    @abstractmethod
    def open(self, engines: EngineSet) -> None: ...

    @abstractmethod
    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, engines: EngineSet) -> int: ...

    @abstractmethod
    def close(self, engines: EngineSet) -> None: ...


def available_transports() -> list[str]:
    return sorted(_REGISTRY)


def make_transport(name: str, config: TransportConfig) -> Transport:
    if name not in _REGISTRY:
        raise ValueError(f"transport: {name!r} is not one of {available_transports()}")
    module, cls = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)(config)
