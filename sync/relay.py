"""Relay ranks: the sync root's node-mates in the weight-update group, behind the root.

A root alone in its group sends every byte through its own GPU's NIC. With relays, the trainer
ranks on the root's node join each weight-update group as ranks 1..R (engines start at
`rank_offset` 1 + R; SGLang takes any world size and offsets), so NCCL's broadcast rings run
through their GPUs and NICs too: the root feeds its node-mates over NVLink and the node sends
over every NIC (`SyncConfig.relays`). A relay receives every bucket and keeps none of it.

The root's transport drives its relays over a small gloo group of [root, *relays] (the control
group, created collectively on every trainer rank): a header (op, bytes) per message, sent without
waiting (a relay still inside a broadcast must not hold up the root, whose own failure handling
then tears the group down): "join" (then address, port, world size, rank, group name) when it
forms a group, "bucket" (bytes) before each broadcast, "leave" when it closes the group, "exit" at
shutdown. Each relay runs `Relay` on a thread of its own, while its main thread runs the export in
lockstep with the other trainer ranks.

Collective contract: a relay takes part in every broadcast of its root's group, in order; a relay
whose group failed (an engine died mid-broadcast) drops it and waits for the next "join". An engine
rank whose ring parent is a relay blocked on a dead rank waits until the group's timeout (gloo; an
NCCL abort is immediate) before it fails: it stays paused meanwhile, as every engine of a failed
update does. Memory on a relay: one buffer of the largest bucket (reused).
"""

from __future__ import annotations

import socket
import threading

import torch
import torch.distributed as dist

from sync.config import SyncConfig
from sync.group import WeightUpdateGroup

JOIN, BUCKET, LEAVE, EXIT = range(4)


def relay_ranks(config: SyncConfig, stage_sources: dict[int, int]) -> dict[int, list[int]]:
    """{stage: the trainer ranks on its source's node that join its group as relays}
    (`config.relays`; None: every node-mate with nccl, none with gloo). Collective over the
    trainer world (every rank tells its host name)."""
    hosts: list = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    taken, relays = set(stage_sources.values()), {}
    for stage, source in sorted(stage_sources.items()):
        mates = [r for r, host in enumerate(hosts) if host == hosts[source] and r not in taken]
        count = config.relays if config.relays is not None else (len(mates) if config.backend == "nccl" else 0)
        relays[stage] = mates[:count]
        taken |= set(relays[stage])
    return relays


class RelayLink:
    """The root's side: its relays' global ranks and the control group it tells them through."""

    def __init__(self, control, relays: list[int]):
        self.control, self.ranks = control, list(relays)
        self._sending: list = []  # headers on their way (a relay may be inside a broadcast)

    def __len__(self) -> int:
        return len(self.ranks)

    def _tell(self, op: int, nbytes: int = 0, rank: int | None = None) -> None:
        self._sending = [(work, sent) for work, sent in self._sending if not work.is_completed()]
        header = torch.tensor([op, nbytes], dtype=torch.int64)
        for dst in self.ranks if rank is None else [rank]:
            self._sending.append((dist.isend(header, dst=dst, group=self.control), header))

    def join(self, address: str, port: int, world_size: int, group_name: str, backend: str, timeout_s: float) -> None:
        """Relay i joins as group rank 1 + i (it blocks in the rendezvous on its own thread)."""
        for i, rank in enumerate(self.ranks):
            self._tell(JOIN, rank=rank)
            params = [(address, port, world_size, 1 + i, group_name, backend, timeout_s)]
            dist.send_object_list(params, dst=rank, group=self.control)

    def bucket(self, nbytes: int) -> None:
        self._tell(BUCKET, nbytes)

    def leave(self) -> None:
        self._tell(LEAVE)

    def exit(self) -> None:
        self._tell(EXIT)
        for work, _ in self._sending:
            work.wait()


class Relay:
    """A relay rank's thread: joins its root's groups and takes part in every broadcast."""

    def __init__(self, control, root: int):
        self.control, self.root = control, root
        self.group: WeightUpdateGroup | None = None
        self.buckets = 0  # buckets relayed (what a test checks)
        self._buffer: torch.Tensor | None = None
        self._thread = threading.Thread(target=self._run, name="sync-relay", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        header = torch.empty(2, dtype=torch.int64)
        while True:
            dist.recv(header, src=self.root, group=self.control)
            op, nbytes = (int(x) for x in header)
            if op == JOIN:
                box = [None]
                dist.recv_object_list(box, src=self.root, group=self.control)
                address, port, world_size, rank, name, backend, timeout_s = box[0]
                self._drop()
                try:
                    self.group = WeightUpdateGroup.join(address, port, rank, world_size, name, backend, timeout_s)
                except Exception:  # noqa: BLE001 - the root aborted the rendezvous; it will ask again
                    self.group = None
            elif op == BUCKET and self.group is not None:
                if self._buffer is None or self._buffer.numel() < nbytes:
                    self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.group.device)
                try:
                    self.group.broadcast(self._buffer[:nbytes])
                    self.buckets += 1
                except Exception:  # noqa: BLE001 - the root's side reports the failure; wait for a new group
                    self._drop()
            elif op in (LEAVE, EXIT):
                self._drop()
                if op == EXIT:
                    return

    def _drop(self) -> None:
        if self.group is not None:
            group, self.group = self.group, None
            group.destroy()

    def join_thread(self, timeout_s: float = 60.0) -> None:
        """After the root said "exit"."""
        self._thread.join(timeout_s)
