"""Owner-side diffs for experts: each expert owner encodes its own experts before the EP gather.

With `sync.delta` the stage source diffs what the export yields against its kept copy
(`sync.delta.KeptCopy`), after the gathers. The experts, nearly all the bytes of a big MoE, are
diffed earlier instead: every expert owner (the ETP-rank-0 member of each EP rank in the expert
source replica: the rank that enters the EP gather, `parallel.mappings.Mapping.export`) keeps the
bytes it last sent of its own experts (after the HF conversion and FP8 quantization, scales
included) and, on a delta update, turns each into a `sync.delta` payload before the EP gather, so
the gather carries payloads (`parallel.mappings.gather_payloads`); the stage source passes them on
unchanged (`KeptCopy.encode_stream(owned=...)`: counted from their headers, never kept there). On
a full anchor the gather carries the tensors as they are and every owner refreshes its copy.

The decision: the coordinator's `WeightSender` decides per update whether it is a delta (and on
which version) or a full anchor, before any rank's export reaches an expert gather, and announces
it (`Decision`) in one broadcast over the trainer's default world that every trainer rank takes
part in once per update (`announce`), on every path: a coordinator that fails before deciding
announces None, and then every owner sends its experts dense and forgets its kept version.

Contract, per update on every trainer rank (`sync.stages.StagedSync`, `sync.pipeline.Funnel`):
  1. `begin(announce(...))` before the export is iterated, then the export through `follow`;
  2. an owner whose kept version is not the announced base (a stream of its that did not finish,
     None announced before) sends each expert as a dense payload naming that base: never a delta
     on a wrong base; the receivers check base version and hash per tensor as for any payload;
  3. the kept version is the announced one once the export ran out (`follow`); a stream that
     stopped halfway leaves none, so rule 2 applies next time. A failed update makes the
     coordinator's next decision an anchor (`WeightSender`): owners just follow it.
Memory on an owner: one version of its own experts on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

from sync.delta import KeptCopy

Stream = Iterable[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class Decision:
    """What the coordinator decided for one update (the same on every trainer rank)."""

    version: int
    delta: bool
    """True: experts travel as payloads on `base_version`; False: a full anchor."""
    base_version: int
    """The version the engines hold (a delta's payloads apply on it)."""
    encoding: str
    """`sync.delta.encoding`."""


def announce(decision: Decision | None, coordinator: int) -> Decision | None:
    """The coordinator's `decision` on every trainer rank (each calls it once per update; only the
    coordinator's argument counts): one broadcast over the default world."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return decision
    box = [decision]
    dist.broadcast_object_list(box, src=coordinator)
    return box[0]


class ExpertOwner:
    """One trainer rank's owner-side diffs (what `parallel.mappings.Mapping.export` calls as its
    `owner`): its experts' kept bytes, this update's decision, and (on a stage source) the names
    that arrived from the EP gather, which the source passes on (`arrived`)."""

    def __init__(self):
        self.kept = KeptCopy()
        self.decision: Decision | None = None
        self.arrived: set[str] = set()
        self._base: int | None = None  # the version kept when this update began

    def begin(self, decision: Decision | None) -> None:
        """This update's decision (None: the coordinator failed before deciding; experts go dense)."""
        self.decision, self._base, self.kept.version = decision, self.kept.version, None
        self.arrived.clear()  # in place: the stage source's encode_stream reads this set
        if decision is not None and not decision.delta:
            self.kept.tensors = {}  # an anchor: the copy holds exactly what it carries

    @property
    def encodes(self) -> bool:
        """Experts travel as payloads in this update (the same on every member of an EP group)."""
        return self.decision is not None and self.decision.delta

    def encode(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """`name`'s payload (host, flat uint8) on the announced base: a diff against the kept bytes
        when they are of that base, else dense (contract point 2)."""
        decision = self.decision
        assert decision is not None and decision.delta, "encode: no delta was announced"
        diff = self._base == decision.base_version
        return self.kept.encode_one(name, tensor, decision.base_version, decision.version, diff, decision.encoding)

    def keep(self, name: str, tensor: torch.Tensor) -> None:
        """`tensor` goes as it is (an anchor, or no decision): kept after an anchor only."""
        if self.decision is not None:
            self.kept.keep(name, tensor)

    def received(self, names: Iterable[str]) -> None:
        """Names the EP gather delivered here (on the gathering rank): owned by their owners."""
        self.arrived.update(names)

    def follow(self, export: Stream) -> Iterator[tuple[str, torch.Tensor]]:
        """`export` as it is; once it ran out the kept copy names the announced version."""
        yield from export
        self.kept.version = self.decision.version if self.decision is not None else None
