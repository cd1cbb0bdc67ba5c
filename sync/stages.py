"""Pipeline parallelism without a funnel: one weight-update group per stage, each stage's source
broadcasting its own layers (`SyncConfig.stage_groups`, the default; `sync.pipeline` is the funnel).

No tensor crosses the trainer network only to reach another trainer rank: stage s's source (TP0 /
DP0 of the stage, `parallel.export.export_source_ranks`) is rank 0 of its own group
`{group_name}_pp{s}`, at its own address and port, and every engine TP rank joins every stage's
group (SGLang keeps groups by `group_name`, each broadcasting from its own rank 0, with the
`rank_offset` and world size the client chooses). The first stage's source is the coordinator: it
owns the `WeightSender`, so pause, session, commit, resume and the "no half-updated model" rules
are those of `sync.sender`, unchanged; its transport (`StageGroupsTransport`) runs the other
stages' sources as turns:

  open   forms stage 0's group, then asks each stage source in stage order to form its own;
  send   broadcasts stage 0's buckets, then hands the turn to stage 1's source, which broadcasts
         its buckets and hands back, and so on; every stage source returns from the update only
         once the coordinator committed it (or gave it up). An engine takes one weight-update request at a
         time (SGLang's scheduler), so stages never broadcast at once: every engine sees stage
         0's buckets, then stage 1's, ..., and no two engines take two stages' buckets in
         different orders (which would deadlock their collectives). Bucket indices run on across
         the stages (the receiver orders collectives by them);
  close  every stage's group, stage by stage.
With `sync.delta` each stage source keeps its own stage's last sent bytes (`KeptCopy`: per shard,
never the whole model on one rank) and sends a delta or a full version as the coordinator's
sender decides (the same for every stage); the tensors are diffed by their owners before the
gathers reach the source (`sync.owner`: experts before the EP gather, the others on their TP diff
owners; every rank takes the decision from one broadcast at the start of each update, before its
export runs, so an export given `StagedSync.owner` carries payloads), and the source keeps only
what it owns itself.

A stage that fails reports the engine and bucket back; the coordinator raises `SyncError` as for
one group (the later stages only run their exports), and the sender drops dead engines and
re-forms every stage's group at the next update.

Control messages (a few small pickled objects per stage and update, never tensors) travel over the
trainer's default world between the coordinator and each stage source, point to point.

Collective contract: every trainer rank calls `StagedSync.update(export, version)` with its own
export generator and iterates it to the end (the coordinator through the sender, stage sources
during their turn, every other rank at once). Memory on each stage source: the sender's two
buckets (`bucket_bytes`) plus the largest tensor, as for one group; nothing is received.
"""

from __future__ import annotations

import dataclasses
from typing import Container, Iterable

import torch
import torch.distributed as dist

from sync.config import SyncConfig, SyncStats
from sync.delta import KeptCopy
from sync.engine_api import EngineEndpoint
from sync.engine_set import EngineSet, SyncError
from sync.owner import Decision, DiffOwner, announce
from sync.relay import Relay, RelayLink
from sync.sender import WeightSender
from sync.syncer import ViaCoordinator
from sync.transports.base import exhaust
from sync.transports.broadcast import BroadcastTransport

Stream = Iterable[tuple[str, torch.Tensor]]


def stage_config(config: SyncConfig, stage: int, stages: int) -> SyncConfig:
    """Stage `stage`'s group: its own name, and its own port where a fixed one was set (one stage:
    the configured name and port)."""
    if stages == 1:
        return config
    port = config.master_port + stage if config.master_port else 0
    return dataclasses.replace(config, group_name=f"{config.group_name}_pp{stage}", master_port=port)


def _ask(rank: int, message: tuple):
    """Coordinator: send `message` to a stage source and return its reply."""
    dist.send_object_list([message], dst=rank)
    reply = [None]
    dist.recv_object_list(reply, src=rank)
    return reply[0]


class StageGroupsTransport(BroadcastTransport):
    """The coordinator's transport: stage 0's group here, the other stages' through their sources
    (`peers` = {stage: global rank}), in stage order."""

    def __init__(self, config: SyncConfig, peers: dict[int, int]):
        super().__init__(stage_config(config, 0, 1 + len(peers)))
        self.peers = dict(sorted(peers.items()))
        self._waiting: list[int] = []  # stage sources inside this update's `serve`, until `release`

    def begin(self) -> None:
        """An update starts: every stage source is now serving it."""
        self._waiting = list(self.peers.values())

    def release(self) -> None:
        """An update ended (committed or not): every stage source returns from `serve` (one that did
        not send runs out its export). Only now: a source that returned earlier could leave its
        group (shutdown) while the engines still hold the version uncommitted, dropping it."""
        for rank in self._waiting:
            dist.send_object_list([("end",)], dst=rank)
        self._waiting = []

    def open(self, engines: EngineSet) -> None:
        super().open(engines)
        for stage, rank in self.peers.items():
            error = _ask(rank, ("open", engines.names))
            if error is not None:
                self.close(engines)
                raise SyncError(f"stage {stage}'s group did not form: {error['message']}", engine=error["engine"])

    def send(self, named_tensors: Stream, version: int, engines: EngineSet) -> int:
        self.first_index = 0
        nbytes = super().send(named_tensors, version, engines)
        first = self.buckets_sent
        for stage, rank in self.peers.items():
            reply = _ask(rank, ("send", version, engines.names, first, self.delta))
            if "message" in reply:
                self.broken = True  # that stage's group may be gone: re-form every stage's next time
                raise SyncError(f"stage {stage}: {reply['message']}", engine=reply["engine"], bucket=reply["bucket"])
            nbytes, first = nbytes + reply["bytes"], first + reply["buckets"]
        return nbytes

    def close(self, engines: EngineSet) -> None:
        super().close(engines)
        for rank in self.peers.values():
            if (
                rank in self._waiting
            ):  # inside an update (re-forming the groups); at shutdown each source closes its own
                _ask(rank, ("close", engines.names))


class StageSource:
    """Stage s > 0's source: its own group and transport, driven by the coordinator's turns."""

    def __init__(self, engines: list[EngineEndpoint], config: SyncConfig, stage: int, stages: int, coordinator: int):
        self.engines = EngineSet(engines, config.timeout_s)
        self.transport = BroadcastTransport(stage_config(config, stage, stages))
        self.coordinator = coordinator
        self._group: EngineSet | None = None
        self.kept = KeptCopy() if config.delta.enabled else None  # this stage's last sent bytes
        self.encoding = config.delta.encoding
        self.owned: Container[str] = ()  # what the owners encoded (`sync.owner`): passed on

    def serve(self, named_tensors: Stream) -> None:
        """One update: answer the coordinator until it says "end"; the export runs out either way."""
        stream, consumed = iter(named_tensors), False
        while True:
            box = [None]
            dist.recv_object_list(box, src=self.coordinator)
            op, *args = box[0]
            if op == "end":
                if not consumed:
                    exhaust(stream)
                return
            reply = None
            if op == "open":
                self._group = self.engines.subset(set(args[0]))
                try:
                    self.transport.open(self._group)
                except SyncError as error:
                    reply = {"message": str(error), "engine": error.engine}
            elif op == "close":
                self.transport.close(self._group or self.engines.subset(set(args[0])))
            elif op == "send":
                version, names, self.transport.first_index, delta = args
                consumed = True
                try:
                    targets = self.engines.subset(set(names))
                    sent = self.transport.send(self._encoded(stream, version, delta), version, targets)
                    reply = {"bytes": sent, "buckets": self.transport.buckets_sent}
                except SyncError as error:  # the transport ran the export out
                    reply = {"message": str(error), "engine": error.engine, "bucket": error.bucket}
            dist.send_object_list([reply], dst=self.coordinator)

    def _encoded(self, stream: Stream, version: int, delta: bool) -> Stream:
        """This stage's stream as the coordinator asked for it: a delta against this stage's kept
        copy (which follows every version it sends), or the full version. SyncError, the export
        run out, for a delta this stage cannot make (its kept copy names no version: a send of
        it failed); the coordinator then anchors."""
        self.transport.delta = delta
        if self.kept is None:
            return stream
        if delta and self.kept.version is None:
            exhaust(stream)
            raise SyncError(f"{self.transport.config.group_name}: no kept version to send a delta on; send an anchor")
        return self.kept.encode_stream(stream, version, full=not delta, encoding=self.encoding, owned=self.owned)

    def add(self, engine: EngineEndpoint) -> None:
        self.engines.add(engine)
        self.transport.broken = True

    def remove(self, name: str) -> None:
        self.engines.drop({name})

    def close(self) -> None:
        self.transport.close(self._group or self.engines)
        self.engines.close()


class StagedSync(ViaCoordinator):
    """A trainer rank's part in a per-stage sync (`stage_sources` = {stage: global rank}), with
    `relays` = {stage: global ranks behind that stage's source in its group} (`sync.relay`).

    Every rank builds one (collectively: the relays' control groups are created here);
    `engines` only matters on stage sources (endpoints to the same engines, in the same order, on
    each). `update` is collective over the trainer world. One stage with relays is a plain sync
    whose group has relays."""

    def __init__(
        self,
        engines: list[EngineEndpoint],
        config: SyncConfig,
        stage_sources: dict[int, int],
        version: int = 0,
        relays: dict[int, list[int]] | None = None,
    ):
        if not stage_sources:
            raise ValueError("stage_sources: empty; pass parallel.export.export_source_ranks()")
        stages = sorted(stage_sources)
        self.coordinator = stage_sources[stages[0]]
        rank = dist.get_rank()
        self.sender: WeightSender | None = None
        self.source: StageSource | None = None
        self.relay: Relay | None = None
        links: dict[int, RelayLink] = {}
        for stage in stages:  # every rank creates every control group, in the same order
            behind = list((relays or {}).get(stage, []))
            if set(behind) & set(stage_sources.values()):
                raise ValueError(f"relays: stage {stage}'s relays {behind} include a stage source; pick other ranks")
            if behind:
                control = dist.new_group([stage_sources[stage], *behind], backend="gloo")
                links[stage_sources[stage]] = RelayLink(control, behind)
                if rank in behind:
                    self.relay = Relay(control, stage_sources[stage])
        self.owner = DiffOwner() if config.delta.enabled else None  # every rank: what it owns
        if rank == self.coordinator:
            peers = {s: stage_sources[s] for s in stages[1:]}
            transport = StageGroupsTransport(config, peers)
            transport.relays = links.get(rank)
            self.sender = WeightSender(engines, config, version, transport=transport)
            self.sender.owners, self.sender.owned = self._begin, self.owner.arrived if self.owner else ()
        elif rank in stage_sources.values():
            stage = next(s for s, r in stage_sources.items() if r == rank)
            self.source = StageSource(engines, config, stage, len(stages), self.coordinator)
            self.source.transport.relays = links.get(rank)
            self.source.owned = self.owner.arrived if self.owner else ()

    def update(self, named_tensors: Stream, version: int) -> SyncStats | None:
        """All trainer ranks: the coordinator returns the sender's stats (or raises its SyncError).
        With `sync.delta` every rank first takes the coordinator's decision (`sync.owner`)."""
        if self.owner is not None:
            named_tensors = self.owner.follow(named_tensors)
        if self.sender is not None:
            self.sender.transport.begin()
            try:
                return self.sender.update(named_tensors, version)
            finally:
                self.sender.transport.release()
        self._begin(None)  # the coordinator's decision arrives here
        if self.source is not None:
            self.source.serve(named_tensors)
        else:
            exhaust(named_tensors)
        return None

    def _begin(self, decision: Decision | None) -> None:
        """The coordinator's `decision` (its argument elsewhere is ignored) to this rank's owner."""
        if self.owner is not None:
            self.owner.begin(announce(decision, self.coordinator))

    def add(self, engine: EngineEndpoint, served_version: int | None) -> None:
        """A restarted engine joins (call on every rank; see `WeightSender.add`)."""
        super().add(engine, served_version)
        if self.source is not None:
            self.source.add(engine)

    def remove(self, name: str) -> None:
        super().remove(name)
        if self.source is not None:
            self.source.remove(name)

    def close(self) -> None:
        """Every stage source leaves its own group (local; engines are told to leave each), and
        lets its relays go."""
        transport = self.sender.transport if self.sender is not None else getattr(self.source, "transport", None)
        if self.sender is not None:
            self.sender.close()
        elif self.source is not None:
            self.source.close()
        if transport is not None and transport.relays is not None:
            transport.relays.exit()
        if self.relay is not None:
            self.relay.join_thread()
