"""The weight-update process group: its own TCPStore rendezvous, never the default world.

Rank 0 is the trainer's source rank and hosts the TCPStore at (master_address, master_port);
engine ranks follow it (SGLang's `rank_offset` / `world_size` convention; an SGLang engine puts
each of its TP ranks in the group, at `rank_offset + tp_rank`). The group is a
`ProcessGroupGloo` (CPU) or `ProcessGroupNCCL` (GPU) built directly on the store, so it neither
needs nor touches `torch.distributed`'s default group: the trainer's world stays as it is and
engine processes need none. One shared group per sender; with pipeline parallelism
`sync.pipeline.stage_stream` funnels every stage's tensors to the single source rank.

Formed exactly as SGLang forms its ranks (`sglang/srt/utils/common.py:
init_custom_process_group`, called by each engine TP rank): SGLang wraps the store in
`PrefixStore(group_name)`, and torch's `_new_process_group_helper` adds `"{group_name}/"` and
`"{device}/"` ("cpu/" for gloo, "cuda/" for NCCL), then sets the backend's sequence number
(rank 0 publishes it in the store, the others wait for it). `store_prefixes` spells those keys
out, so a trainer rank 0 built here meets SGLang's ranks key for key. SGLang runs no collective
when it joins, so neither does this group: the first collective of every member is the first
bucket's broadcast (a join-time barrier would be received as bucket data by SGLang). With gloo,
`join` returns once every rank connected; NCCL connects lazily, so its `join` returns at once and
a missing rank shows up at the first broadcast.

Every member must call `WeightUpdateGroup.join(...)`, then the same sequence of `broadcast`
calls, then `destroy`. Each collective waits at most `timeout_s`. Rank 0 may first `host_store` (which
returns at once, listening on master_address only) so it can tell the engines its port before joining.
A rendezvous that cannot complete (a member died before joining) is aborted by dropping the
hosted store: every rank blocked in `join` then fails within a fraction of a second instead of
waiting out `timeout_s`. For that, rank 0 joins through its own `client_store`, so the hosting
object's owner holds the only reference to the server.
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from sync import traffic

BACKENDS = ("gloo", "nccl")
CONNECT_S = 10.0
"""How long a joining rank tries to reach rank 0's store: rank 0 hosts it before any engine is told
its port, so a store that does not answer by then is a wrong address or port, not a slow peer."""


def host_store(master_address: str, world_size: int, timeout_s: float, port: int = 0) -> dist.TCPStore:
    """Rank 0: start the rendezvous store on `port` (0: a free one). It listens on `master_address`
    only (torch's own store would listen on every interface): the socket is bound here and handed
    to the store, which owns it from then on."""
    listener = socket.socket(socket.AF_INET6 if ":" in master_address else socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((master_address, port))
        listener.listen(1024)
    except OSError as error:
        listener.close()
        raise ValueError(
            f"master_address/master_port: cannot listen on {master_address}:{port} ({error}); "
            "use an address of this host and a free port (0 picks one)"
        ) from None
    return dist.TCPStore(
        master_address,
        listener.getsockname()[1],
        world_size,
        is_master=True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=listener.detach(),
    )


def client_store(master_address: str, master_port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """A client connection to a hosted store (rank 0 joins through one to keep the rendezvous abortable)."""
    return dist.TCPStore(master_address, master_port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))


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
        _check_backend(backend)  # before any connection attempt
        if store is None and rank != 0:
            _reachable(master_address, master_port)
        if store is None:
            store = (
                host_store(master_address, world_size, timeout_s, master_port)
                if rank == 0
                else client_store(master_address, master_port, world_size, timeout_s)
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
        _check_backend(backend)
        if not 0 <= rank < world_size or world_size < 2:
            raise ValueError(f"rank/world_size: need 0 <= rank < world_size >= 2, got {rank}/{world_size}")
        self.rank, self.world_size = rank, world_size
        self.group_name, self.backend = group_name, backend
        self.timeout = timedelta(seconds=timeout_s)
        self._store = store  # rank 0's store serves the others: keep it alive with the group
        for prefix in store_prefixes(group_name, backend):
            store = dist.PrefixStore(prefix, store)
        if backend == "gloo":
            self._pg = dist.ProcessGroupGloo(store, rank, world_size, self.timeout)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            options.group_name = group_name
            self._pg = dist.ProcessGroupNCCL(store, rank, world_size, options)
        self._pg._set_sequence_number_for_group()  # as torch does for SGLang's ranks (store keys)

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
        nbytes = tensor.numel() * tensor.element_size()
        traffic.count("broadcast", sent=nbytes if self.rank == src else 0, received=0 if self.rank == src else nbytes)
        return self._pg.broadcast([tensor], opts)

    def wait(self, work: dist.Work) -> None:
        if not work.wait(self.timeout):
            raise TimeoutError(f"broadcast on {self.group_name!r} timed out after {self.timeout}")

    def destroy(self) -> None:
        """Local: close this rank's connections (peers blocked on it then fail fast). Idempotent."""
        if self._pg is not None:
            pg, self._pg = self._pg, None
            if self.backend == "nccl":
                pg.abort()
            else:
                pg.shutdown()
        self._store = None


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend: {backend!r} is not one of {BACKENDS}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend: 'nccl' needs CUDA; use backend='gloo' on CPU")


def _reachable(address: str, port: int, within_s: float = CONNECT_S) -> None:
    """Raise ValueError unless something accepts connections at (address, port) within `within_s`."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            socket.create_connection((address, port), timeout=min(within_s, 2.0)).close()
            return
        except OSError as error:
            if time.monotonic() > deadline:
                raise ValueError(
                    f"master_address/master_port: nothing answers at {address}:{port} after "
                    f"{within_s:.0f} s ({error}); check the sync source's address and port"
                ) from None
            time.sleep(0.2)


def address_for(peer_hosts: list[str]) -> str:
    """The address of this host that `peer_hosts` reach: loopback when they are all on this host,
    else the local address of the route to the first remote one (no packet is sent)."""
    remote = [h for h in peer_hosts if h not in ("127.0.0.1", "localhost", "::1")]
    if not remote:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((remote[0], 9))  # UDP connect only picks the route
        except OSError as error:
            raise ValueError(
                f"master_address: no route from this host to the engine host {remote[0]} "
                f"({error}); set sync.master_address to an address the engines reach"
            ) from None
        return sock.getsockname()[0]


def store_prefixes(group_name: str, backend: str) -> list[str]:
    """The store prefixes of an SGLang group rank, outermost first (see the module docstring)."""
    return [group_name, f"{group_name}/", "cpu/" if backend == "gloo" else "cuda/"]
