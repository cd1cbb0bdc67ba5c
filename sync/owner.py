"""Owner-side diffs: every tensor is diffed by the trainer rank that owns it, before the gather
that brings it to the stage source, so no single rank copies, keeps and compares a whole stage.

With `sync.delta` the stage source could diff what the export yields against its kept copy
(`sync.delta.KeptCopy`), after the gathers: one rank would then take the stage's every byte to its
host. Instead, with an owner (`parallel.mappings.Mapping.export`'s `owner`):
- experts: every expert owner (the ETP-rank-0 member of each EP rank in the expert source
  replica: the rank that enters the EP gather) keeps the bytes it last sent of its own experts
  (after the HF conversion and FP8 quantization, scales included) and, on a delta update, turns
  each into a `sync.delta` payload before the EP gather, so the gather carries payloads
  (`parallel.gathers.gather_payloads`);
- every other tensor (attention, dense MLP, norms, embedding, head): each Megatron parameter has
  a diff owner among the TP members of the source replica (`parallel.export.diff_owners`,
  balanced by bytes). The TP gather, still dense (inside the node), delivers the parameter to
  its diff owner instead of member 0; the diff owner converts it to HF (and FP8) as member 0
  would, keeps its last sent bytes and encodes the payloads, and hands them to member 0 (the
  stage source) in two messages per parameter (`parallel.gathers.hand_to_first`).
The stage source passes every owned tensor on unchanged (`KeptCopy.encode_stream(owned=...)`:
counted from their headers, never kept there); it keeps only what it owns itself, here. On a
full anchor the tensors travel as they are (the diff owners hand over the dense HF tensors) and
every owner refreshes its copy.

Why design "diff owner after a dense TP gather" rather than diffing each TP shard before it: the
engines get one payload per HF tensor with a hash of the whole tensor (`sync.delta`'s wire format),
which a column-split tensor's shards cannot combine, and Megatron's fused shards (QKV, gate/up)
map onto several HF tensors, reordered by `to_hf`. Whole HF tensors on one owner keep the wire
format, the hashes and the conversion as they are; the dense gather stays inside the TP group
(NVLink), while the kept copies and the compares (on each member's GPU, its kept copy brought up
over PCIe: `sync.delta.KeptCopy`) are spread over its members (`moe_rl.plan.delta`).

The decision: the coordinator's `WeightSender` decides per update whether it is a delta (and on
which version) or a full anchor, before any rank's export reaches a gather, and announces it
(`Decision`) in one broadcast over the trainer's default world that every trainer rank takes
part in once per update (`announce`), on every path: a coordinator that fails before deciding
announces None, and then every owner sends its tensors dense and forgets its kept version.

Contract, per update on every trainer rank (`sync.stages.StagedSync`, `sync.pipeline.Funnel`):
  1. `begin(announce(...))` before the export is iterated, then the export through `follow`;
  2. an owner whose kept version is not the announced base (a stream of its that did not finish,
     None announced before) sends each tensor as a dense payload naming that base: never a delta
     on a wrong base; the receivers check base version and hash per tensor as for any payload;
  3. the kept version is the announced one once the export ran out (`follow`); a stream that
     stopped halfway leaves none, so rule 2 applies next time. A failed update makes the
     coordinator's next decision an anchor (`WeightSender`): owners just follow it.
Memory on an owner: one version of its own experts and dense tensors on the host (the stage
source: of those it owns, no other). Behind the pipeline funnel (`sync.pipeline.Funnel` with PP >
1) there is no owner: the first stage's source diffs every stage's tensors.
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
    """True: owned tensors travel as payloads on `base_version`; False: a full anchor."""
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


class DiffOwner:
    """One trainer rank's owner-side diffs (what `parallel.mappings.Mapping.export` calls as its
    `owner`): the kept bytes of the tensors it owns (experts, dense diff-owned parameters), this
    update's decision, and (on a stage source) the names its owners encoded or kept, which the
    source passes on (`arrived`)."""

    def __init__(self):
        self.kept = KeptCopy()
        self.decision: Decision | None = None
        self.arrived: set[str] = set()
        self._base: int | None = None  # the version kept when this update began

    def begin(self, decision: Decision | None) -> None:
        """This update's decision (None: the coordinator failed before deciding; tensors go dense)."""
        self.decision, self._base, self.kept.version = decision, self.kept.version, None
        self.arrived.clear()  # in place: the stage source's encode_stream reads this set
        if decision is not None and not decision.delta:
            self.kept.tensors = {}  # an anchor: the copy holds exactly what it carries

    @property
    def encodes(self) -> bool:
        """Owned tensors travel as payloads in this update (the same on every trainer rank)."""
        return self.decision is not None and self.decision.delta

    def encode(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """`name`'s payload (flat uint8, on `tensor`'s device) on the announced base: a diff against the kept bytes
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
        """Names the gathers delivered here (on the stage source): encoded or kept by their owners."""
        self.arrived.update(names)

    def follow(self, export: Stream) -> Iterator[tuple[str, torch.Tensor]]:
        """`export` as it is; once it ran out the kept copy names the announced version."""
        yield from export
        self.kept.version = self.decision.version if self.decision is not None else None
