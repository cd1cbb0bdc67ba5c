"""The weight sync modelled from the bytes each link carries (`moe-rl plan`; modelled, not measured).

One sync, for the configured layout and `sync:` options, as turns: with `sync.stage_groups`
(PP > 1) each pipeline stage's source broadcasts its own layers over its own weight-update group,
one stage after the other (an engine takes one weight-update request at a time, so stages cannot
overlap on the engines); with the funnel (`stage_groups: false`) the first stage's source
receives the other stages' tensors and broadcasts everything in one turn. Inside a turn, export
(gathers, FP8 quantization) and broadcast are pipelined bucket by bucket, so a turn lasts as long
as its most loaded link; the sync lasts the sum of its turns. Links of a turn (root = the
turn's source GPU, R = the NICs of the root's node in the group: 1 + `relays`, at most
`cluster.nics_per_node`):

  gather NVLink      into the root from its node: TP shards, the EP members on the root's node
                     and the off-node members' bytes they forward as rails
  gather NICs        from EP members on other nodes, spread over the rails (`parallel.gathers.Rails`:
                     the EP members on the root's node, each receiving its riders over its NIC)
  broadcast NVLink   with relays: the root feeds the ring through its node-mates
  broadcast NICs     the root's node sends the turn's bytes over R NICs (NCCL rings, one per NIC)
  engine node NICs   each engine node receives the turn's bytes once over its NICs
                     (min(its GPUs in the group, nics_per_node)) and forwards inside over NVLink
Bytes of a NIC link are per NIC (the link's bytes / its NICs).
  funnel NIC         funnel only: the other stages' bytes into the first stage's source
  FP8 quantization   on the owners' GPUs (each EP member its experts), at the rate the GPU check
                     measured (`benchmarks/gpu_metrics.json`), where it did
  delta encode       with `sync.delta` (`moe_rl.plan.delta`), as built: the busiest sending rank's
                     PCIe (each TP member of the source replica: its 1/tp of the non-expert
                     tensors; expert owners: their experts) and node's host memory, the TP gather
                     dense into the diff owners then their payloads into the root, the EP gather
                     encoded (`gathered`; with the funnel every gather and the funnel dense);
                     owner-side (TP shards diffed before the TP gather: not built): the busiest
                     owner's PCIe and node's host memory, with the funnel the slowest stage's
                     (stages encode at once)
  cross-datacentre   with `moe-rl plan --link-gbps G`: trainer and engines in two datacentres joined
                     by one link of G Gb/s, which every byte of the turn crosses once (each NCCL ring
                     crosses it once, the rings share it), at the NIC efficiency

Each link moves bytes at its Gb/s (`cluster.nic_gbps`, `cluster.nvlink_gbps`) x an efficiency:
NIC_EFFICIENCY / NVLINK_EFFICIENCY (modelled), or `nic_efficiency` / `nvlink_efficiency` from
the GPU check's file where measured there. Ranks are placed node-major (trainer first), groups as
Megatron forms them (order tp-cp-ep-dp-pp; experts etp-ep-edp-pp).
"""

from __future__ import annotations

from dataclasses import dataclass, field

GB = 1e9
NIC_EFFICIENCY = 0.8
"""Modelled: NCCL's bus bandwidth on large messages over one 400 Gb/s InfiniBand NIC (nccl-tests
report ~40-48 GB/s of 50); replaced by the GPU check's `nic_efficiency` where measured."""
NVLINK_EFFICIENCY = 0.8
"""Modelled, likewise, for NVLink inside a node; replaced by a measured `nvlink_efficiency`."""


@dataclass(frozen=True)
class Link:
    name: str
    bytes: float
    gb_per_s: float  # effective

    @property
    def seconds(self) -> float:
        return self.bytes / (self.gb_per_s * GB) if self.bytes else 0.0


@dataclass
class SyncLinks:
    """The modelled sync: per turn (a stage, or the funnel's one turn) the links it loads."""

    turns: list[list[Link]]
    nics: int  # R, the root node's NICs in the group
    efficiency: dict[str, str] = field(default_factory=dict)  # link kind -> "0.8 (modelled)" / "(measured ...)"

    @property
    def seconds(self) -> float:
        return sum(max(link.seconds for link in turn) for turn in self.turns)

    @property
    def bottleneck(self) -> Link:
        """The link that decides the most seconds: per name, the sum of its seconds over the turns
        where it is the slowest (its bytes summed over every turn)."""
        decided: dict[str, float] = {}
        for turn in self.turns:
            slowest = max(turn, key=lambda link: link.seconds)
            decided[slowest.name] = decided.get(slowest.name, 0.0) + slowest.seconds
        name = max(decided, key=decided.get)
        links = [link for turn in self.turns for link in turn if link.name == name]
        return Link(name, sum(link.bytes for link in links), links[0].gb_per_s)

    def per_link(self) -> dict[str, tuple[float, float]]:
        """{link: (bytes, seconds)} summed over the turns."""
        out: dict[str, tuple[float, float]] = {}
        for turn in self.turns:
            for link in turn:
                b, s = out.get(link.name, (0.0, 0.0))
                out[link.name] = (b + link.bytes, s + link.seconds)
        return out


@dataclass(frozen=True)
class StageBytes:
    """Bytes a pipeline stage sends in the sync's wire format: dense (TP-sharded or replicated)
    and routed experts (ETP x EP sharded)."""

    dense: float
    experts: float

    @property
    def total(self) -> float:
        return self.dense + self.experts


def model_sync(
    *,
    stages: list[StageBytes],
    trainer,
    engines,
    cluster,
    stage_groups: bool,
    relays: int,
    quantize: list[float] | None = None,
    quantize_gb_per_s: float | None = None,
    measured: dict[str, dict] | None = None,
    encode: list[list[Link]] | None = None,
    gathered: list[StageBytes] | None = None,
    link_gbps: float | None = None,
) -> SyncLinks:
    """The links of each turn. `trainer`: tp, pp, ep, etp (expert_tp), world_size; `engines`:
    count, tp; `cluster`: gpus_per_node, nic_gbps, nics_per_node, nvlink_gbps; `relays`: trainer
    ranks behind the root on its node; `quantize`: per stage, the full-precision bytes the busiest
    owner quantizes (None: no FP8, or no measured rate), at `quantize_gb_per_s` (the GPU check's);
    `encode`: per stage, the delta encode's links (None: a full sync; one list with the funnel for
    an encode at the root); `gathered`: per stage, the bytes the gathers and the funnel carry (None:
    `stages`; an as-built delta: the dense part the full sync's, the experts encoded); `link_gbps`: a
    cross-datacentre link between the trainer and the engines (None: one datacentre)."""
    measured = measured or {}
    gathered = gathered or stages
    nic_eff, nic_note = _efficiency(measured, "nic_efficiency", NIC_EFFICIENCY)
    nvl_eff, nvl_note = _efficiency(measured, "nvlink_efficiency", NVLINK_EFFICIENCY)
    nic = cluster.nic_gbps / 8 * nic_eff
    nvlink = cluster.nvlink_gbps / 8 * nvl_eff
    per_node = cluster.gpus_per_node
    nics = min(1 + relays, cluster.nics_per_node, per_node)
    # an engine node's GPUs in the group: engines of fewer GPUs than a node share one
    engine_nics = min(per_node if engines.tp >= per_node else engines.tp * engines.count, cluster.nics_per_node)
    world, pp = trainer.world_size, trainer.pp
    stage_ranks = world // pp

    def gather(stage: int, nbytes: StageBytes) -> list[Link]:
        root = stage * stage_ranks
        node = root // per_node
        tp, etp, ep = trainer.tp, trainer.expert_tp, trainer.ep
        on_node = nbytes.dense * (tp - 1) / tp if (root + tp - 1) // per_node == node else 0.0
        off_dense = nbytes.dense * (tp - 1) / tp - on_node
        share = nbytes.experts / ep  # each EP member's experts (after its node-local ETP gather)
        members = [root + i * etp for i in range(ep)]
        rails = [m for m in members if m // per_node == node]  # parallel.gathers.Rails
        off = len(members) - len(rails)
        nic_rails = min(len(rails), cluster.nics_per_node) if off else 1
        riders = -(-off // nic_rails)  # the busiest rail NIC's off-node members
        on_node += share * (ep - 1 - (riders if nic_rails > 1 else off))  # node-mates' own + forwarded
        return [
            Link("gather, each NIC into the root's node", off_dense + share * riders, nic),
            Link("gather, NVLink into the root", on_node, nvlink),
        ]

    def broadcast(nbytes: float) -> list[Link]:
        links = [
            Link("broadcast, each NIC of the root's node", nbytes / nics, nic),
            Link("broadcast, each NIC into an engine node", nbytes / engine_nics, nic),
        ]
        if nics > 1:
            links.append(Link("broadcast, NVLink root to relays", nbytes, nvlink))
        return links

    def quantized(stage: int) -> list[Link]:
        if not quantize or not quantize_gb_per_s:
            return []
        return [Link("FP8 quantization (owner GPU)", quantize[stage], quantize_gb_per_s)]

    def crossing(nbytes: float) -> list[Link]:
        return [Link("cross-datacentre link", nbytes, link_gbps / 8 * nic_eff)] if link_gbps else []

    turns: list[list[Link]] = []
    if stage_groups or pp == 1:
        for stage, nbytes in enumerate(stages):
            encoded = encode[stage] if encode else []
            turns.append(
                gather(stage, gathered[stage])
                + broadcast(nbytes.total)
                + quantized(stage)
                + encoded
                + crossing(nbytes.total)
            )
    else:  # the funnel: one turn, everything through the first stage's source
        total = sum(s.total for s in stages)
        # every stage's owners encode at once: the slowest stage's encode links
        slowest = [max(links, key=lambda link: link.seconds) for links in zip(*encode)] if encode else []
        turn = gather(0, gathered[0]) + broadcast(total) + quantized(0) + slowest + crossing(total)
        # the funnel arrives point-to-point on the root's own NIC, with its off-node gathers when
        # no relay takes them
        own = turn[0].bytes if nics == 1 else 0.0
        funnel = sum(s.total for s in gathered) - gathered[0].total
        turn.append(Link("funnel + gather, the root's NIC in", funnel + own, nic))
        turns.append(turn)
    return SyncLinks(turns, nics, {"NIC": nic_note, "NVLink": nvl_note})


def _efficiency(measured: dict[str, dict], key: str, default: float) -> tuple[float, str]:
    if key in measured:
        m = measured[key]
        return float(m["value"]), f"{m['value']:.2f} (measured on {m.get('gpu', '?')}, {m.get('date', '?')})"
    return default, f"{default:g} (modelled)"
