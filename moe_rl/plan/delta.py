"""The delta sync (`sync.delta`) and the bytes each engine rank receives, as `moe-rl plan` models
them (modelled, not measured).

Wire bytes of a delta. A tensor of n elements of e bytes, a fraction d of them changed
(`sync.delta.density`), goes as the smallest of (`sync.delta.encoding` "auto"; a forced one as itself):
  gaps     d n (GAP_BYTES + e)        a uint16 gap to each changed element, then its bytes (escapes
                                      for gaps >= 65536 are rare below d ~ 1/65536: not counted)
  bitmap   n / 8 + d n e              one bit per element, then the changed elements' bytes
  dense    n e                        every element
plus HEADER_BYTES per tensor. Below d = 1/16 gaps win: at 1% a bf16 tensor sends 2% of its bytes,
an FP8 one 3%. FP8's float32 scales (one per block x block) are few and most change every step:
modelled dense. A full anchor goes every `sync.delta.full_every` versions, so a step costs on
average ((F - 1) x a delta + a full sync) / F.

Who encodes: two designs, both modelled (`Owners.of_stage`: the same owners, 1/tp of the dense
bytes on each TP member of the stage's source replica, 1/ep of the experts on each EP member).
  as built   (`sync/owner.py`, `parallel/mappings.py` `Mapping.export`, `sync/delta.py` `KeptCopy`):
             every expert owner (the ETP-rank-0 member of each EP rank, after its node-local ETP
             gather) keeps its own experts' last sent bytes in host memory and diffs them before
             the EP gather, which then carries encoded bytes; every other tensor is gathered dense
             over TP into its diff owner, a TP member (`parallel.export.diff_owners`, balanced by
             bytes), which keeps and diffs it and hands the payloads to the stage source: into
             the root, the TP gather carries its own 1/tp dense and the other members' payloads.
             A sending rank compares on its GPU: its kept copy crosses its PCIe host -> device
             (SOURCE_PCIE_PASSES times) and its node's host memory reads it HOST_PASSES times (the
             changed elements written back are few); the broadcast carries encoded bytes. With the
             funnel (`sync.stage_groups: false`, PP > 1) the first stage's source diffs every stage
             after dense gathers (no owners there).
  owner-side (not built): every owner diffs its own shard before any gather, in the engine's
             format, against the copy of it it last sent, kept in pinned host memory; the TP and
             EP gathers and the broadcast then carry encoded bytes. An owner's shard crosses PCIe
             once per sync (the kept copy up to the GPU for the compare, or the shard down to the
             host; the changed elements written back are few), and the kept copies of a node's
             owners are read through its host memory once, as built. The wire format's whole-tensor
             hash and Megatron's fused shards are why the TP part is not built (`sync/owner.py`).
Either encode lasts the longer of its PCIe and host-memory links, pipelined with the wire bucket
by bucket like the FP8 quantization (links of the turn, `moe_rl.plan.sync_links`). PCIe is the
bound for a compare that keeps up with it: `sync.delta` compares and hashes on the GPU (torch ops,
SUM64), at a measured `delta_encode_gb_per_s` per rank where the GPU check's file
(`benchmarks/gpu_metrics.json`) has one (`tests/gpu/test_delta_cuda.py`).

Bytes per engine rank. SGLang 0.5.23's `/update_weights_from_distributed` has every TP rank of an
engine join the group (rank_offset + tp_rank) and receive each whole bucket
(`sglang/srt/model_executor/model_runner_components/weight_updater.py`,
`WeightUpdater._receive_bucketed_weights_from_distributed`: `FlattenedTensorBucket.empty` at the
full shapes, then `torch.distributed.broadcast`); its weight loaders then keep the rank's slice.
So an engine rank receives the whole sync for its own shard (weights of the engine split over
tp / attn_dp for dense, tp for experts): `engine_rank_ratio`, tp with attn_dp 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_rl.plan.sync_links import GB, Link, SyncLinks

GAP_BYTES = 2
HEADER_BYTES = 64 + 2 * 8
"""`sync.delta`'s header (64 bytes) and a 2-D shape (int64 a dimension), per tensor."""
PCIE_GB_PER_S = 50.0
"""Modelled: one GPU's PCIe Gen5 x16 link, one direction (64 GB/s line rate; pinned copies reach
~50 GB/s on H100/H200 hosts). Not measured here."""
HOST_MEMORY_GB_PER_S = 400.0
"""Modelled: a node's host memory read bandwidth (two sockets of 8-channel DDR5-4800, 614 GB/s
peak; ~2/3 of it for streaming reads). Not measured here."""
SOURCE_PCIE_PASSES = 1
"""As built, a sending rank's PCIe carries what it diffs once: `KeptCopy` takes each tensor's kept
copy host -> device, compares on the GPU and takes only the payload back."""
HOST_PASSES = 1
"""As built, a node's host memory reads its sending ranks' kept copies once (the copy up to the
GPUs); the changed elements written back into them are a density's worth."""


def encoded_fraction(element_bytes: int, density: float, encoding: str = "auto") -> float:
    """The fraction of a tensor's bytes its delta takes (headers aside)."""
    sizes = {
        "gaps": density * (GAP_BYTES + element_bytes),
        "bitmap": 1 / 8 + density * element_bytes,
        "dense": float(element_bytes),
    }
    return (min(sizes.values()) if encoding == "auto" else sizes[encoding]) / element_bytes


@dataclass(frozen=True)
class Owners:
    """A stage's ranks that diff, {global trainer rank: bytes they diff, in the engine's format}
    (`of_stage`; the funnel's root alone diffs everything)."""

    shards: dict[int, float]

    @classmethod
    def of_stage(cls, stage: int, dense: float, experts: float, trainer) -> Owners:
        """`dense`, `experts`: the stage's bytes in the engine's format; `trainer`: tp, pp, ep,
        expert_tp, world_size (ranks placed tp fastest, EP members `expert_tp` apart)."""
        root = stage * (trainer.world_size // trainer.pp)
        shards: dict[int, float] = {}
        for i in range(trainer.tp):
            shards[root + i] = shards.get(root + i, 0.0) + dense / trainer.tp
        for j in range(trainer.ep):
            member = root + j * trainer.expert_tp
            shards[member] = shards.get(member, 0.0) + experts / trainer.ep
        return cls(shards)

    def per_node(self, gpus_per_node: int) -> dict[int, float]:
        nodes: dict[int, float] = {}
        for rank, nbytes in self.shards.items():
            nodes[rank // gpus_per_node] = nodes.get(rank // gpus_per_node, 0.0) + nbytes
        return nodes

    def encode_links(self, gpus_per_node: int, gb_per_s: float = PCIE_GB_PER_S) -> list[Link]:
        """The busiest owner's shard at `gb_per_s` (PCIe, or a slower measured encode), the busiest
        node's kept copies through its host memory."""
        return [
            Link("delta encode, PCIe of the busiest owner", max(self.shards.values()), gb_per_s),
            Link(
                "delta encode, host memory of busiest node",
                max(self.per_node(gpus_per_node).values()),
                HOST_MEMORY_GB_PER_S,
            ),
        ]


def built_encode_links(owners: Owners, gpus_per_node: int, measured_gb_per_s: float | None = None) -> list[Link]:
    """As built: the busiest sending rank's PCIe (SOURCE_PCIE_PASSES), the busiest node's host
    memory (HOST_PASSES) and, where the GPU check measured one, the encode's rate on the GPU."""
    busiest = max(owners.shards.values())
    links = [
        Link("delta encode, PCIe of the busiest sending rank", SOURCE_PCIE_PASSES * busiest, PCIE_GB_PER_S),
        Link(
            "delta encode, host memory of busiest node",
            HOST_PASSES * max(owners.per_node(gpus_per_node).values()),
            HOST_MEMORY_GB_PER_S,
        ),
    ]
    if measured_gb_per_s:
        links.append(Link("delta encode, GPU compare (measured)", busiest, measured_gb_per_s))
    return links


@dataclass
class DeltaSync:
    """One delta and a step's average, beside the full sync (`moe-rl plan`'s `sync delta:` line), for
    one design of who encodes (module docstring): "as built", or "owner-side" (dense shards not built)."""

    design: str
    density: float
    encoding: str
    full_every: int
    bytes: float  # wire bytes of one delta, to each engine
    links: SyncLinks  # one delta's links, the encode among them
    full_seconds: float  # an anchor: the full sync (as built, with the kept copies following)
    kept: dict[int, float]  # node -> host bytes of the kept copies
    rate: str = f"PCIe, {PCIE_GB_PER_S:g} GB/s modelled"  # where the encode's rate comes from
    owner_side: DeltaSync | None = None  # as built: the owner-side design beside it

    @property
    def seconds(self) -> float:
        return self.links.seconds

    @property
    def per_step(self) -> float:
        """Seconds a step, anchors amortised: one full sync every `full_every` versions."""
        return ((self.full_every - 1) * self.seconds + self.full_seconds) / self.full_every

    def encode(self) -> tuple[float, float]:
        """(bytes, seconds) over the sync's turns of the slowest encode link."""
        encodes = {name: v for name, v in self.links.per_link().items() if name.startswith("delta encode")}
        return max(encodes.values(), key=lambda v: v[1])

    def render(self) -> list[str]:
        worst = self.links.bottleneck
        nbytes, seconds = self.encode()
        turns = len(self.links.turns)
        each = f", summed over {turns} stage turns" if turns > 1 else ""
        if self.design == "as built":
            who = (
                f"each TP member compares its share of the non-expert tensors (after the TP gather into it) and "
                f"each expert owner its own experts (before the EP gather) on its GPU against its kept copy, "
                f"which crosses PCIe host -> device ({SOURCE_PCIE_PASSES}x); slowest encode link "
                f"{nbytes / GB:.1f} GB{each}"
            )
        else:
            who = f"the busiest sending rank diffs {nbytes / GB:.1f} GB of its shard against its host copy{each}"
        lines = [
            f"sync delta ({self.design}; sync.delta, at density {self.density:g}, encoding {self.encoding}): "
            f"{self.bytes / GB:.2f} GB to each engine, ~{self.seconds:.2f} s a delta (bottleneck {worst.name}), "
            f"~{self.per_step:.2f} s a step with a full anchor every {self.full_every} versions "
            f"(anchor ~{self.full_seconds:.2f} s)",
            f"  encode: {who}, {seconds:.2f} s ({self.rate}; host memory {HOST_MEMORY_GB_PER_S:g} GB/s modelled)",
        ]
        if self.owner_side:
            o = self.owner_side
            lines.append(
                f"  owner-side diffs (TP shards before the TP gather: not built): ~{o.per_step:.2f} s a step "
                f"(~{o.seconds:.2f} s a delta, bottleneck {o.links.bottleneck.name}): every owner diffs its own "
                f"shard before the gathers, which then all carry encoded bytes"
            )
        return (
            lines
            + [f"sync delta links ({self.design}, modelled, one delta):"]
            + [
                f"  {name:42s} {nbytes / GB:8.2f} GB {seconds:7.2f} s"
                for name, (nbytes, seconds) in self.links.per_link().items()
            ]
        )


def engine_rank_ratio(engines, dense: float, experts: float) -> tuple[float, float]:
    """(own shard bytes, received / own) of one engine rank for a sync of `dense` + `experts` bytes:
    SGLang's broadcast gives every TP rank the whole sync (module docstring)."""
    own = dense / (engines.tp // engines.attn_dp) + experts / engines.tp
    return own, (dense + experts) / own


def node_ranges(per_node: dict[int, float], nodes: int) -> str:
    """`node 0 98.4, nodes 1-7 81.9 each, nodes 8-79 none` (GB), equal neighbours merged."""
    runs: list[tuple[int, int, float]] = []
    for node in range(nodes):
        value = round(per_node.get(node, 0.0) / GB, 1)
        if runs and runs[-1][2] == value:
            runs[-1] = (runs[-1][0], node, value)
        else:
            runs.append((node, node, value))
    parts = []
    for first, last, value in runs:
        shown = f"{value:.1f}" if value else "none"
        parts.append(
            f"node {first} {shown}" if first == last else f"nodes {first}-{last} {shown}{' each' * bool(value)}"
        )
    return ", ".join(parts)
