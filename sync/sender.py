"""Trainer side of the weight sync: one call per training step moves a new version to every engine.

    sender = WeightSender(engines, SyncConfig(transport="broadcast", bucket_bytes=512 << 20))
    sender.update(export_stream, version)      # on the source rank; other ranks exhaust the export
    sender.close()

`export_stream` is any iterable of `(hf_name, tensor)`; with Megatron it is `parallel`'s
streaming export, which runs gathers over TP/EP/ETP on every trainer rank: the source rank
(rank 0 of the weight-update group) passes it to `update`, every other trainer rank iterates it
in lockstep (`exhaust`).

Pipeline parallelism (PP > 1): each stage's export yields its layers on that stage's source
rank. By default every stage broadcasts its own layers over its own weight-update group, stage
after stage, and the first stage's source owns this sender (`sync.stages.StagedSync`, built on
every rank); with `stage_groups: false` the other stages' tensors funnel to the first stage's
source instead (`sync.pipeline.stage_stream`), which broadcasts them all over one group:

    sync = StagedSync(engines, config, export_source_ranks())      # every trainer rank
    sync.update(export_hf_weights(model, bridge, bucket_bytes), version)

`update` is the weight update, as numbered steps (`sync.engine_api` has the engine's side):
  1. refuse a version that does not increase (repeating the committed version only catches up
     engines that are behind, see below);
  2. (re)open the transport if needed (forms the weight-update group with the target engines);
  3. pause generation (`mode`) on every target; flush the KV cache unless the mode is in_place;
     with `pause_mode: none` neither: every target `stages_versions` and generates on (steps 3
     and 8 are skipped; a target that got part of a version still serves the committed one);
  4. open the weight-update session where the transport loads in place (SGLang's rule);
  5. transport.send: stream buckets; every target acknowledges every bucket (with `sync.delta`:
     the stream as payloads against the kept copy, or a full anchor, see below);
  6. close the session, on failure too;
  7. commit: `update_weight_version` on every target, only if steps 5 and 6 fully succeeded;
  8. resume generation: every target after a commit; after a failure, only the targets whose
     weights were not touched (the failure came before any bucket). SGLang loads buckets in
     place, so a target that got part of the version holds a mix of two versions still labelled
     as the old one: it stays paused (`WeightSender.partial`) and serves again only once a full
     resend of a version succeeds, which the next `update` does (it always includes them).
An engine that does not answer `/health` after a failure (or cannot resume after a commit) is
dead: it is dropped (named in `SyncStats.dropped` / `SyncError.dropped`), and the next update
re-forms the group without it. On failure, `SyncError` names the engine and bucket; no engine
serves a new version until it committed all of it. When the failure was an engine dying
(`error.dropped` is not empty), the caller retries the same version with a fresh export: the
live engines then commit it (`moe_rl`'s trainer does). An orchestrator that gives up instead
restarts the `partial` engines from the last published weights.

Deltas (`SyncConfig.delta`, `sync.delta`): the sender keeps the bytes it last sent (`kept`, on
the host) and sends each new version as payloads against them, every payload naming the version
it applies on, each engine checking every tensor's hash and the whole version at its commit. A
full anchor goes instead at the first update, every `delta.full_every` versions, after any failed
update (the kept copy no longer says what the engines hold), to engines behind or holding part
of a version, when the transport or an engine cannot take deltas, and for a catch-up resend.
Engines refusing a delta fail the update like any engine error: they stay paused until the anchor.
The decision is made at step 1, before anything is sent, and handed to `owners` (set by the shape:
`sync.owner` announces it to every trainer rank, whose owners encode their tensors before the
gathers reach this rank: experts, and dense tensors on their TP diff owners; those names, `owned`,
pass through the kept copy unchanged and are never kept here).

Engines that come back (an orchestrator restarted one): `add(engine, served_version)` makes it a
member again; if it serves an older version than the committed one (or, `served_version=None`,
weights this sender never sent: it kept running while the trainer restarted from an older run
checkpoint, and the orchestrator had it leave the dead source's groups first) it is *behind*, and
`update(stream, sender.version)` (the committed version, exported again) forms a group with only
the engines behind and sends them that version, without pausing the others; the next new
version re-forms the group with every member. The orchestrator gives a restarted engine work
only after that. (The disk transport catches up from the version already published.)
An engine new to the run (the fleet grows) joins the same way under a new name; one taken out
of the fleet is `remove`d like a dead one, and the next update re-forms the group without it.
"""

from __future__ import annotations

import time
from typing import Callable, Container, Iterable

import torch

from sync.config import SyncConfig, SyncStats
from sync.delta import KeptCopy
from sync.engine_api import EngineEndpoint
from sync.engine_set import EngineSet, SyncError, describe, require_health
from sync.owner import Decision
from sync.syncer import Syncer
from sync.transports import make_transport
from sync.transports.base import Transport, exhaust


class WeightSender(Syncer):
    """The plain sender (a `sync.syncer.Syncer`): the sync source's side of one weight-update group."""

    def __init__(
        self, engines: list[EngineEndpoint], config: SyncConfig, version: int = 0, transport: Transport | None = None
    ):
        if not engines:
            raise ValueError("engines: need at least one engine to sync weights to")
        self.config = config
        self.version = version  # the last committed version
        self.engines = EngineSet(engines, config.timeout_s)
        self.behind: set[str] = set()  # members serving an older version than `version`
        self.partial: set[str] = set()  # members paused with a partly loaded version (step 8)
        # `transport`: one built by the caller (per-stage groups, `sync.stages`), else config.transport's
        self.transport = transport or make_transport(config.transport, config)
        self._group: EngineSet | None = None  # the members the transport's group was formed with
        self.kept = KeptCopy() if config.delta.enabled else None  # what the engines hold, for deltas
        self.anchored: int | None = None  # the version of the last full anchor
        # owner-side diffs (`sync.owner`), set by the shape: announces each update's decision to
        # every trainer rank, and the names the owners encoded (passed on, not kept here)
        self.owners: Callable[[Decision | None], None] | None = None
        self.owned: Container[str] = ()

    def add(self, engine: EngineEndpoint, served_version: int | None) -> None:
        """A (re)started or new engine serving `served_version` joins, replacing a member of its name.
        None: weights this sender did not send (an engine kept running while the trainer restarted
        from an older checkpoint): it is behind whatever it serves, and gets the committed version."""
        self.engines.add(engine)
        self.transport.broken = True  # the group must be re-formed with the new process
        self.partial.discard(engine.name)
        if served_version is None or served_version < self.version:
            self.behind.add(engine.name)
        elif served_version == self.version:
            self.behind.discard(engine.name)
        else:
            raise ValueError(f"served_version: {served_version} is newer than the committed {self.version}")

    def remove(self, name: str) -> None:
        """Forget a member the orchestrator knows is dead or took out of the fleet (the next update
        then does not wait on it and re-forms the group without it)."""
        self._forget({name})

    def pending(self, version: int) -> bool:
        """A newer version, or the committed one again while engines are behind it or hold part of one."""
        return version > self.version or (version == self.version and bool(self.behind or self.partial))

    def update(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> SyncStats:
        """Source rank only. Returns what was sent; raises SyncError (no engine serves a mix)."""
        # 1. versions only increase; the committed one again only for engines behind
        decision = None
        try:
            if not self.pending(version):
                raise ValueError(f"version: {version} is stale or repeated (last committed {self.version})")
            names = self.behind | self.partial if version == self.version else set(self.engines.names)
            targets = self.engines.subset(names)
            if targets.engines and self.kept is not None:
                delta = self._delta_due(version, targets)
                decision = Decision(version, delta, self.version, self.config.delta.encoding)
        except BaseException:  # the other ranks still get a decision (none) and run their exports out
            self._announce(None)
            exhaust(named_tensors)
            raise
        self._announce(decision)  # every rank waits for it before its export reaches a gather
        if not targets.engines:  # every engine died: the restarted ones catch up to this version
            exhaust(named_tensors)
            self.version = version
            return SyncStats(version, 0, 0.0)
        start, committed, touched, session = time.perf_counter(), False, False, False
        pausing = self.config.pause_mode != "none"
        marks: list[tuple[str, float]] = []  # each phase and when it began, for SyncStats.phases
        try:
            if not pausing and not all(engine.stages_versions for engine in targets.engines):
                raise ValueError(
                    "pause_mode 'none' needs engines that serve the committed version while the next "
                    f"one arrives; {[e.name for e in targets.engines if not e.stages_versions]} load "
                    "buckets into the live model (SGLang): use pause_mode abort, retract or in_place"
                )
            # 2. (re)form the group with the targets
            if self.transport.broken or self._group is None or self._group.names != targets.names:
                self.transport.close(self._group or targets)
                self._group = targets.subset(set(targets.names))
                self.transport.open(self._group)
            # 3. pause (+ flush: SGLang refuses it while in_place keeps requests in the batch)
            marks.append(("pause", time.time()))
            if pausing:
                self._on_all(targets, "pause_generation", lambda e: e.pause_generation(self.config.pause_mode))
                if self.config.pause_mode != "in_place":
                    self._on_all(targets, "flush_cache", lambda e: e.flush_cache())
            # 4. the session SGLang requires around in-place loads
            if self.transport.session:
                session = True
                self._on_all(targets, "begin_weight_update", lambda e: e.begin_weight_update())
            # 5. send every bucket, acknowledged by every target (a delta, or the full version)
            touched = True
            marks.append(("buckets", time.time()))
            stream = self._encoded(named_tensors, version, decision is not None and decision.delta)
            nbytes = self.transport.send(stream, version, targets)
            # 6. close the session
            session = False
            marks.append(("commit", time.time()))
            if self.transport.session:
                self._on_all(targets, "end_weight_update", lambda e: e.end_weight_update())
            # 7. commit
            self._on_all(targets, "update_weight_version", lambda e: e.update_weight_version(str(version)))
            committed = True
            self.version = version
            self.behind -= set(targets.names)
            self.partial -= set(targets.names)
        except BaseException as failure:
            exhaust(named_tensors)  # if we failed before sending: other ranks run the export
            if self.kept is not None:  # the engines may hold anything now: the next is an anchor
                self.kept.invalidate()
            if session:
                targets.call(lambda e: e.end_weight_update())  # best effort: the next begin needs it
            if isinstance(failure, SyncError):
                failure.dropped = self._drop_dead(targets)
            raise
        finally:
            # 8. resume: every target after a commit; after a failure only untouched weights
            marks.append(("resume", time.time()))
            if touched and not committed:
                self.partial |= set(targets.names) & set(self.engines.names)
            elif not pausing:  # nothing was paused: a dead engine shows at the next update
                dead = []
            else:  # (a commit cleared `partial` of the targets; earlier partial ones stay paused)
                dead = targets.subset(set(targets.names) - self.partial).call(lambda e: e.continue_generation())
                if committed:
                    self._forget(set(dead))
        ends = [when for _, when in marks[1:]] + [time.time()]
        return SyncStats(
            version,
            nbytes,
            time.perf_counter() - start,
            [n for n in targets.names if n not in dead],
            sorted(dead),
            [(phase, began, end) for (phase, began), end in zip(marks, ends)],
            self.kept.stats if self.kept is not None else None,
        )

    def _delta_due(self, version: int, targets: EngineSet) -> bool:
        """Whether `version` goes to `targets` as a delta (see the module docstring); else it is an
        anchor. Decided before anything is sent and announced to the owners (`sync.owner`)."""
        delta = (
            self.kept.version == self.version  # the kept copy is what every engine committed last
            and version > self.version  # a new version (a catch-up resend goes in full)
            and self.anchored is not None
            and version - self.anchored < self.config.delta.full_every
            and not (self.behind | self.partial) & set(targets.names)
            and self.transport.takes_deltas(targets)
        )
        if not delta:
            self.anchored = version
        return delta

    def _announce(self, decision: Decision | None) -> None:
        """This update's decision to every trainer rank's owner (`owners`; once per update,
        None when it failed before deciding)."""
        if self.owners is not None:
            self.owners(decision)

    def _encoded(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, delta: bool):
        """The stream as the targets get it: with `sync.delta`, payloads against the kept copy when a
        delta is due, else the full version (the kept copy follows it); the tensors that their
        owners encoded (`owned`) pass as they come."""
        self.transport.delta = delta
        if self.kept is None:
            return named_tensors
        return self.kept.encode_stream(
            named_tensors, version, full=not delta, encoding=self.config.delta.encoding, owned=self.owned
        )

    def _drop_dead(self, targets: EngineSet) -> list[str]:
        """After a failure: drop the targets that no longer answer /health; returns their names."""
        dead = set(targets.call(require_health))
        self._forget(dead)
        return sorted(dead)

    def _forget(self, names: set[str]) -> None:
        """Members gone (dead or removed): out of every set; the next update re-forms the group."""
        if names:
            self.engines.drop(names)
            self.behind -= names
            self.partial -= names
            self.transport.broken = True

    def _on_all(self, engines: EngineSet, what: str, call) -> None:
        if failed := engines.call(call):
            raise SyncError(f"{what} failed: {describe(failed)}", engine=next(iter(failed)))

    def close(self) -> None:
        """Engines and this rank leave the group; the sender cannot be used afterwards."""
        self.transport.close(self._group or self.engines)
        self.engines.close()
