"""The weight-update process group: its own TCPStore rendezvous, never the default world.

Rank 0 is the trainer's source rank and hosts the TCPStore at (master_address, master_port);
engine ranks follow it (SGLang's `rank_offset` / `world_size` convention). The group is a
`ProcessGroupGloo` (CPU) or `ProcessGroupNCCL` (GPU) built directly on a `PrefixStore`, so it
neither needs nor touches `torch.distributed`'s default group: the trainer's world stays as it
is and engine processes need none. One shared group per sender; with pipeline parallelism
`sync.pipeline.stage_stream` funnels every stage's tensors to the single source rank.

Every member must call `WeightUpdateGroup.join(...)` (the rendezvous: it blocks until all
`world_size` ranks joined or `timeout_s` passed), then the same sequence of `broadcast` calls,
then `destroy`. Each collective waits at most `timeout_s`. Rank 0 may first `host_store` (which
returns at once and retries busy ports) so it can tell the engines its port before joining.
A rendezvous that cannot complete (a member died before joining) is aborted by dropping the
hosted store: every rank blocked in `join` then fails within a fraction of a second instead of
waiting out `timeout_s`. For that, rank 0 joins through its own `client_store`, so the hosting
object's owner holds the only reference to the server.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")


def host_store(master_address: str, world_size: int, timeout_s: float, port: int = 0) -> dist.TCPStore:
    """Rank 0: start the rendezvous store on `port` (0: a free one, retried if taken meanwhile)."""
    for attempt in range(5):
        try:
            return dist.TCPStore(
                master_address,
                port or _free_port(master_address),
                world_size,
                is_master=True,
                timeout=timedelta(seconds=timeout_s),
                wait_for_workers=False,
            )
        except dist.DistNetworkError:
            if port or attempt == 4:
                raise
    raise AssertionError("unreachable")


def client_store(master_address: str, master_port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """A client connection to a hosted store (rank 0 joins through one to keep the rendezvous abortable)."""
    return dist.TCPStore(master_address, master_port, world_size, is_master=False,
                         timeout=timedelta(seconds=timeout_s))


class WeightUpdateGroup:
    @classmethod
    def join(
        cls,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "gloo",
        timeout_s: float = 300.0,
        store: dist.TCPStore | None = None,
    ) -> "WeightUpdateGroup":
        """Every rank; `store` only on rank 0 when it called `host_store` first."""
        if store is None:
            store = dist.TCPStore(
                master_address,
                master_port,
                world_size,
                is_master=(rank == 0),
                timeout=timedelta(seconds=timeout_s),
                wait_for_workers=False,
            )
        return cls(store, rank, world_size, group_name, backend, timeout_s)

    def __init__(
        self,
        store: dist.TCPStore,
        rank: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout_s: float,
    ):
        if backend not in BACKENDS:
            raise ValueError(f"backend: {backend!r} is not one of {BACKENDS}")
        if backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("backend: 'nccl' needs CUDA; use backend='gloo' on CPU")
        if not 0 <= rank < world_size or world_size < 2:
            raise ValueError(f"rank/world_size: need 0 <= rank < world_size >= 2, got {rank}/{world_size}")
        self.rank, self.world_size = rank, world_size
        self.group_name, self.backend = group_name, backend
        self.timeout = timedelta(seconds=timeout_s)
        self._store = store  # rank 0's store serves the others: keep it alive with the group
        store = dist.PrefixStore(group_name, store)
        if backend == "gloo":
            self._pg = dist.ProcessGroupGloo(store, rank, world_size, self.timeout)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            self._pg = dist.ProcessGroupNCCL(store, rank, world_size, options)
        # Rendezvous now, not at the first bucket: a missing rank fails here, named as such.
        self.barrier()

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """All ranks: `tensor` on `src` is copied into `tensor` on every rank (in place)."""
        self.wait(self.broadcast_async(tensor, src))

    def broadcast_async(self, tensor: torch.Tensor, src: int = 0) -> dist.Work:
        """`broadcast`, started; finish it with `wait(work)` (no extra memory: in place)."""
        if self._pg is None:
            raise RuntimeError(f"group {self.group_name!r} was destroyed; create a new one")
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        return self._pg.broadcast([tensor], opts)

    def wait(self, work: dist.Work) -> None:
        if not work.wait(self.timeout):
            raise TimeoutError(f"broadcast on {self.group_name!r} timed out after {self.timeout}")

    def barrier(self) -> None:
        """All ranks; a one-element broadcast (gloo and NCCL alike, bounded by the timeout)."""
        self.broadcast(torch.zeros(1, dtype=torch.uint8, device=self.device))

    def destroy(self) -> None:
        """Local: close this rank's connections (peers blocked on it then fail fast). Idempotent."""
        if self._pg is not None:
            pg, self._pg = self._pg, None
            if self.backend == "nccl":
                pg.abort()
            else:
                pg.shutdown()
        self._store = None


def _free_port(address: str) -> int:
    with socket.socket() as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]
