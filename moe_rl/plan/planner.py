"""`make_plan(config)`: where a run's processes go and whether they fit, before any GPU is touched.

A plan places the trainer ranks and the engines on `cluster` (GPUs numbered node-major; the
trainer takes the first `trainer.world_size`, engines follow, `engines.tp` GPUs each, never
straddling a node unless they own whole nodes), lists the trainer's layout and Megatron's parallel
groups (`moe_rl.plan.groups`, CP included), estimates memory per GPU, checks long sequences
(`moe_rl.plan.sequences`: the model's positions, the engines' KV cache) and the bytes every engine
receives per weight sync. Any impossibility is a ValueError naming the field and the fix.

Parameter counts are exact: the HF model is built on the meta device (no memory, ~2 s for
DeepSeek-V3) and its unique parameters are classified by layer and as routed expert
(`.experts.` in the HF name) or not; the embedding goes to the first pipeline stage, the final
norm and `lm_head` to the last.

Trainer memory per GPU, for the worst pipeline stage (bytes; B = bytes of `trainer.precision`,
2 for bf16, 4 for fp32; D, X = dense and routed-expert parameters of the stage):
  local params   Pd = D / tp,  Pe = X / (etp * ep)
  weights        B * (Pd + Pe)
  gradients      4 * (Pd + Pe)                 fp32 main-grad buffers (Megatron DDP)
  optimizer      O * (Pd / (dp cp) + Pe / edp) Adam m, v in fp32 (8), plus the fp32 main params in
                                                bf16 (O = 12; fp32: O = 8); distributed optimizer,
                                                dense state sharded over DP x CP
                 O * (Pd + Pe)                 without it
  reference      B * (Pd + Pe)                 the frozen KL reference (algorithm.kl_coef > 0; none with
                                                lora: the reference is the base with its adapters off)
  activations    per microbatch and layer, s = data.seq_length, b = micro_batch_size, h = hidden
                 (with trainer.max_tokens_per_microbatch: s b = that budget, a micro-batch's
                 padded tokens; every term below is linear in s b), divided by `trainer.cp`: each
                 CP rank holds 1/cp of the tokens (the keys and values CP gathers for attention
                 live inside one layer's attention and are not counted),
                 sequence parallel dividing by tp (Korthikanti et al. 2022, flash attention: no
                 s^2 term, SwiGLU MLPs; bytes of 16-bit activations, twice that in fp32):
                   attention + norms  15 s b h
                   dense MLP          2 s b h + 6 s b f                   (f = intermediate_size)
                   MoE MLP            2 s b h + k (2 s b h + 6 s b f_e) + shared expert MLP
                 times the layers of the stage times the microbatches 1F1B keeps in flight on
                 stage p (min(pp - p, microbatches)); with `trainer.recompute` only each layer's
                 input (B s b h) is kept, plus one layer's full activations; the last stage
                 adds fp32 logits (4 s b vocab / tp).
Not counted: CUDA context, NCCL buffers, allocator fragmentation (keep ~10 GB of headroom).

Sync buffers: the trainer's stage sources hold two buckets (`sync.bucket_bytes`, packed while the
other is on the wire), each relay one; every engine GPU one receive buffer per bucket.

Engine memory per GPU (SGLang): weights E * (dense / (tp / attn_dp) + experts / tp) (E = bytes of
`cluster.param_dtype`, what the engines hold; with `sync.fp8_blocks` N the engines serve the FP8
checkpoint the sync sends: decoder layers at 1 + 4 / N^2 bytes a parameter; DP attention replicates
attention over attn_dp groups), one sync bucket; the rest of `engines.mem_fraction_static` of the
GPU is KV cache, which must hold the longest sequence (`moe_rl.plan.sequences`).

Bytes per sync: every engine receives the whole exported HF state dict in the trainer's precision
(broadcast), i.e. B x the model's unique parameters; with `sync.fp8_blocks` N, decoder linears
travel as FP8 (1 byte + a 4-byte scale per N x N block, `fp8_sync_bytes`).

With `lora:` (rank r), the base is frozen: gradients and optimizer state cover only the adapters,
A = r x (in + out) per adapted linear (fused q/k/v and gate/up share one A; every routed expert has
its own), and each sync sends B x A bytes: the adapter, not the model.

Seconds per sync: modelled from the bytes each link carries (`moe_rl.plan.sync_links`: per stage turn,
gathers, broadcast NICs of the root's node, engine nodes' NICs, NVLink), with `cluster.nic_gbps`,
`cluster.nics_per_node`, `cluster.nvlink_gbps`; printed with the most loaded link, beside the
published sync time of the same model (SYNC_ANCHORS) where there is one. Where the GPU check has
measured figures (`benchmarks/gpu_metrics.json`, written by `scripts/gpu_check.sh`), the plan lists
them, takes link efficiencies from them, and models the FP8 quantization of `sync.fp8_blocks` at
the measured rate on the owners' GPUs.

Delta sync (`sync.delta.enabled`): the same links with each stage's deltas at `sync.delta.density`
on the broadcast, as built (expert owners diff before the EP gather; each TP member its share of
the other tensors after the TP gather, which stays dense, into it) and owner-side (the TP shards
diffed before the TP gather too: not built); the encode as links of its
turn, anchors amortised, and the kept copies as host memory per node (`moe_rl.plan.delta`, which
also gives the bytes an engine rank receives against its own shard). `make_plan(..., link_gbps=G)`
(`moe-rl plan --link-gbps G`) adds a cross-datacentre link of G Gb/s that every byte crosses once.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

from moe_rl.config import PARAM_DTYPES, RunConfig
from moe_rl.plan.delta import (
    HEADER_BYTES,
    PCIE_GB_PER_S,
    DeltaSync,
    Owners,
    built_encode_links,
    encoded_fraction,
    engine_rank_ratio,
    node_ranges,
)
from moe_rl.plan.groups import layout_line, parallel_groups, span
from moe_rl.plan.launch import engine_commands
from moe_rl.plan.sequences import check_kv_cache, sequence_notes
from moe_rl.plan.sync_links import Link, StageBytes, SyncLinks, model_sync
from parallel.model import PRECISIONS

GB = 1e9
HEADROOM_GB = 10.0
"""Memory the estimate leaves out (CUDA context, NCCL buffers, fragmentation): a note below it."""
GPU_METRICS = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_metrics.json"  # the checkout's
"""What the `gpu` tier measured on a real GPU (tests/gpu/metrics.py); absent until a GPU check ran."""
SYNC_ANCHORS: dict[tuple[str, float], str] = {
    ("Qwen3MoeForCausalLM", 30.5): "verl Qwen3-30B-A3B ~7 s; NeMo-RL 0.74-1.0 s",
    ("Qwen3MoeForCausalLM", 235.1): "Miles Qwen3-235B-A22B 10.75 s NCCL, 3.2 s RDMA; checkpoint-engine 6.2 s",
    ("DeepseekV3ForCausalLM", 671.0): "NeMo-RL DeepSeek-V3 2.4-2.8 s",
    ("Glm4MoeForCausalLM", 355.0): "slime GLM-4.5-355B 48 s",
    ("DeepseekV3ForCausalLM", 1026.4): "Perplexity Kimi-K2 1.3 s RDMA; Miles 7.2 s RDMA, 53 s broadcast",
}
"""Published full-weight sync times, keyed by (HF architecture, billions of parameters): a model
matches with the architecture and a parameter count within 10%."""


@dataclass(frozen=True)
class ParamCounts:
    """Unique parameters of the HF model, split by where they live."""

    dense_per_layer: tuple[int, ...]
    expert_per_layer: tuple[int, ...]
    embedding: int
    head: int  # final norm + lm_head (0 for lm_head when tied)
    tensors: int = 0  # parameter tensors, each with its own header in a delta
    layer_tensors: int = 0  # of them in decoder layers (FP8 adds a scale tensor to each: counted so)

    @property
    def total(self) -> int:
        return sum(self.dense_per_layer) + sum(self.expert_per_layer) + self.embedding + self.head

    @property
    def experts(self) -> int:
        return sum(self.expert_per_layer)


def count_parameters(hf_config) -> ParamCounts:
    return _count(json.dumps(hf_config.to_dict(), sort_keys=True, default=str))


@functools.lru_cache(maxsize=16)
def _count(config_json: str) -> ParamCounts:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = json.loads(config_json)
    hf = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    layers = hf.num_hidden_layers
    dense, expert, embedding, head, tensors, layer_tensors = [0] * layers, [0] * layers, 0, 0, 0, 0
    for name, param in model.named_parameters():  # tied parameters appear once
        parts = name.split(".")
        tensors += 1
        if parts[:2] == ["model", "layers"]:
            layer = int(parts[2])
            layer_tensors += 1
            (expert if ".experts." in name else dense)[layer] += param.numel()
        elif name.startswith(("lm_head", "model.norm")):
            head += param.numel()
        else:
            embedding += param.numel()
    return ParamCounts(tuple(dense), tuple(expert), embedding, head, tensors, layer_tensors)


@dataclass
class Plan:
    """What `moe-rl plan` prints."""

    placement: dict[int, list[str]]  # node -> "GPUs a-b: role" lines
    layout: str  # the trainer's axes in Megatron's order (`moe_rl.plan.groups.layout_line`)
    groups: dict[str, list[list[int]]]
    trainer_memory: dict[str, float]  # GB per GPU, worst stage
    trainer_stage: int
    engine_memory: dict[str, float]
    sync_bytes: int
    sync_links: SyncLinks
    params: ParamCounts
    sync_anchor: str | None = None  # a published sync time of this model
    engine_rank: tuple[float, float] | None = None  # (own shard bytes, received / own) of one engine rank
    delta: DeltaSync | None = None  # with sync.delta.enabled
    engine_commands: list[str] = field(default_factory=list)  # `moe_rl.plan.launch.engine_commands`
    notes: list[str] = field(default_factory=list)

    def render(self) -> str:
        lines = ["placement:"]
        for node, rows in self.placement.items():
            lines += [f"  node {node}: {row}" for row in rows]
        lines.append(f"trainer layout: {self.layout}")
        lines.append("trainer parallel groups (global trainer ranks):")
        for name, groups in self.groups.items():
            shown = ", ".join(span(g) for g in groups[:3]) + (", ..." if len(groups) > 3 else "")
            lines.append(f"  {name:4s} {len(groups)} x {len(groups[0])}: {shown}")
        lines.append(f"parameters: {self.params.total / 1e9:.2f} B ({self.params.experts / 1e9:.2f} B routed experts)")
        lines.append(
            f"trainer memory per GPU (GB, stage {self.trainer_stage}): "
            + "  ".join(f"{k} {v:.1f}" for k, v in self.trainer_memory.items())
        )
        lines.append("engine memory per GPU (GB): " + "  ".join(f"{k} {v:.1f}" for k, v in self.engine_memory.items()))
        if self.delta:
            nodes = len(self.placement)
            lines.append(
                f"host memory per node (GB, pinned: the delta's kept copies): {node_ranges(self.delta.kept, nodes)}"
            )
        anchor = f" (public: {self.sync_anchor})" if self.sync_anchor else ""
        worst = self.sync_links.bottleneck
        delta = (
            f"; delta as built ~{self.delta.per_step:.2f} s a step ({self.delta.bytes / GB:.2f} GB a delta at "
            f"density {self.delta.density:g}, anchors amortised: sync delta below)"
            if self.delta
            else ""
        )
        lines.append(
            f"sync: {self.sync_bytes / GB:.2f} GB to each engine per step, ~{self.sync_seconds:.1f} s modelled, "
            f"bottleneck {worst.name} ({worst.bytes / GB:.1f} GB at {worst.gb_per_s:.0f} GB/s){delta}{anchor}"
        )
        if self.engine_rank:
            own, ratio = self.engine_rank
            lines.append(
                f"sync per engine rank: receives {self.sync_bytes / GB:.2f} GB for its own {own / GB:.2f} GB shard, "
                f"{ratio:.1f}x (SGLang's /update_weights_from_distributed broadcasts every bucket to every TP rank)"
            )
        links = self.sync_links
        lines.append(
            f"sync links (modelled: {len(links.turns)} stage turn(s), {links.nics} NIC(s) of the root's node in "
            f"the group; efficiency NIC {links.efficiency['NIC']}, NVLink {links.efficiency['NVLink']}):"
        )
        for name, (nbytes, seconds) in links.per_link().items():
            lines.append(f"  {name:42s} {nbytes / GB:8.1f} GB {seconds:7.2f} s")
        if self.delta:
            lines += self.delta.render()
        if self.engine_commands:
            lines.append("engine launch commands (SGLang 0.5.23; RUN_DIR, NODE<n> and PORT are filled in at start):")
            lines += [f"  {command}" for command in self.engine_commands]
        return "\n".join(lines + [f"note: {n}" for n in self.notes])

    @property
    def sync_seconds(self) -> float:
        return self.sync_links.seconds


def load_gpu_metrics(path: Path = GPU_METRICS) -> dict[str, dict]:
    """{name: {value, unit, gpu, date, ...}} measured by the GPU check, or {} where none ran."""
    return json.loads(path.read_text()).get("measured", {}) if path.is_file() else {}


def make_plan(config: RunConfig, gpu_metrics: Path = GPU_METRICS, link_gbps: float | None = None) -> Plan:
    """Validate `config` against its cluster and return the plan; ValueError when it cannot run.
    `link_gbps`: trainer and engines in two datacentres joined by one link of that many Gb/s."""
    if link_gbps is not None and link_gbps <= 0:
        raise ValueError(f"--link-gbps {link_gbps:g}: must be > 0 (Gb/s of the link between the datacentres, e.g. 10)")
    if config.cluster is None:
        raise ValueError(
            "cluster: missing; add a cluster section (nodes, gpus_per_node, gpu_memory_gb) to plan "
            "a GPU run (see configs/models/)"
        )
    if config.engines.kind != "sglang" and config.is_rl:
        raise ValueError(
            f"engines.kind={config.engines.kind!r}: GPU plans place SGLang engines; set engines.kind: sglang"
        )
    config.trainer.check_context_parallel_precision(gpu_te=True)  # a plan is for GPUs
    placement = place(config)
    hf = config.model.load_hf_config()
    _check_engine_model(config, hf)
    counts = count_parameters(hf)
    dtype_bytes = PRECISIONS[config.trainer.precision].itemsize  # what the trainer holds and exports
    adapter = None if config.lora is None else lora_parameters(hf, counts, config.lora.rank, config.lora.targets)
    stage, trainer = trainer_memory(config, hf, counts, dtype_bytes, adapter)
    engine = engine_memory(config, hf, counts, PARAM_DTYPES[config.cluster.param_dtype]) if config.is_rl else {}
    kv_note = check_kv_cache(config, hf, engine["kv_cache"]) if config.is_rl else None
    sync_bytes = (sum(adapter) if adapter else counts.total) * dtype_bytes
    if adapter is None and config.sync.fp8_blocks:
        sync_bytes = fp8_sync_bytes(counts, config.sync.fp8_blocks, dtype_bytes)
    measured = load_gpu_metrics(gpu_metrics)
    plan = Plan(
        placement=placement,
        layout=layout_line(config.trainer),
        groups=parallel_groups(config.trainer),
        trainer_memory=trainer,
        trainer_stage=stage,
        engine_memory=engine,
        sync_bytes=sync_bytes,
        sync_links=sync_model(config, hf, counts, dtype_bytes, adapter, measured, link_gbps),
        params=counts,
        sync_anchor=None if adapter else sync_anchor(hf, counts),  # anchors are full-weight syncs
    )
    if config.is_rl:
        plan.engine_commands = engine_commands(config)
        wire = wire_stages(config, hf, counts, dtype_bytes, adapter)
        plan.engine_rank = engine_rank_ratio(config.engines, sum(s.dense for s in wire), sum(s.experts for s in wire))
    if config.is_rl and adapter is None and config.sync.delta.enabled:
        plan.delta = delta_model(config, hf, counts, dtype_bytes, measured, plan.sync_links, link_gbps)
        if config.engines.kind == "sglang":
            plan.notes.append(
                "sync.delta is modelled here, but SGLang 0.5.23 engines cannot apply a delta yet (its "
                "broadcast route has no custom loader): `moe-rl train` refuses it (docs/delta-sync.md)"
            )
        if plan.delta.per_step >= plan.sync_seconds:
            plan.notes.append(
                f"sync.delta saves no time here: ~{plan.delta.per_step:.2f} s a step against "
                f"~{plan.sync_seconds:.2f} s full, bound by {plan.delta.links.bottleneck.name}; it still "
                f"sends {plan.delta.bytes / GB:.2f} GB, not {plan.sync_bytes / GB:.2f} GB"
            )
    if adapter is None and config.sync.fp8_blocks:
        plan.notes.append(
            f"sync.fp8_blocks={config.sync.fp8_blocks}: decoder linears as FP8 blocks, about "
            f"{sync_bytes / GB:.2f} GB per sync instead of {counts.total * dtype_bytes / GB:.2f} GB"
        )
    if adapter is None and config.sync.fp8_blocks and "fp8_quantize_gb_per_s" in measured:
        rate = measured["fp8_quantize_gb_per_s"]
        plan.notes.append(
            f"FP8 quantization on the owners' GPUs, pipelined with the broadcast, at {rate['value']:.0f} GB/s "
            f"(measured on {rate['gpu']}, {rate['date']})"
        )
    if measured:
        shown = ", ".join(f"{name} {m['value']:.3g} {m['unit'].split(' ')[0]}" for name, m in sorted(measured.items()))
        plan.notes.append(f"measured on GPU ({gpu_metrics.name}): {shown}")
    if config.trainer.precision == "fp32":
        plan.notes.append(
            "trainer.precision=fp32: weights, activations and syncs at 4 bytes a value, and no packed "
            "sequences; GPUs train in bf16 (trainer.precision: bf16)"
        )
    plan.notes += sequence_notes(config, hf) + ([kv_note] if kv_note else [])
    if adapter is not None:
        plan.notes.append(
            f"lora: {sum(adapter) / 1e6:.1f} M adapter parameters ({adapter[1] / 1e6:.1f} M in routed "
            f"experts), {sum(adapter) / counts.total:.3%} of the model; each sync loads a new adapter"
        )
    if config.is_rl and adapter is None:
        buckets = -(-plan.sync_bytes // config.sync.bucket_bytes)
        plan.notes.append(f"{buckets} buckets of <= {config.sync.bucket_bytes / 2**20:.0f} MiB per sync")
    if trainer["total"] > config.cluster.gpu_memory_gb - HEADROOM_GB:
        plan.notes.append(f"trainer leaves < {HEADROOM_GB:g} GB per GPU for CUDA/NCCL/fragmentation: expect OOM risk")
    return plan


def stage_params(config: RunConfig, hf, counts: ParamCounts, adapter) -> list[tuple[float, float, float]]:
    """Per pipeline stage: (decoder dense, routed experts, embedding + head) parameters; with LoRA
    the stage's share of the adapter (dense, experts, none)."""
    t = config.trainer
    per_stage = hf.num_hidden_layers // t.pp
    parts = []
    for p in range(t.pp):
        layers = range(p * per_stage, (p + 1) * per_stage)
        dense = sum(counts.dense_per_layer[i] for i in layers)
        experts = sum(counts.expert_per_layer[i] for i in layers)
        ends = (counts.embedding if p == 0 else 0) + (counts.head if p == t.pp - 1 else 0)
        parts.append((dense, experts, ends) if adapter is None else (adapter[0] / t.pp, adapter[1] / t.pp, 0))
    return parts


def sync_model(
    config: RunConfig, hf, counts: ParamCounts, dtype_bytes: int, adapter, measured: dict[str, dict], link_gbps=None
) -> SyncLinks:
    """The sync's links for this layout and `sync:` options (`moe_rl.plan.sync_links`); a LoRA sync
    moves only the adapter, from the source of each stage as a full sync would."""
    fp8 = config.sync.fp8_blocks if adapter is None else None
    stages = wire_stages(config, hf, counts, dtype_bytes, adapter)
    quantize = _quantize(config, stage_params(config, hf, counts, adapter), dtype_bytes, measured, fp8)
    return _links(config, stages, measured, quantize, link_gbps=link_gbps)


def wire_stages(config: RunConfig, hf, counts: ParamCounts, dtype_bytes: int, adapter) -> list[StageBytes]:
    """Each stage's bytes in a full sync's wire format (the engines' format): the trainer's
    precision, decoder layers as FP8 blocks with `sync.fp8_blocks`."""
    fp8 = config.sync.fp8_blocks if adapter is None else None
    layer_bytes = dtype_bytes if fp8 is None else 1 + 4 / fp8**2
    return [
        StageBytes(d * layer_bytes + e * dtype_bytes, x * layer_bytes)
        for d, x, e in stage_params(config, hf, counts, adapter)
    ]


def delta_model(
    config: RunConfig,
    hf,
    counts: ParamCounts,
    dtype_bytes: int,
    measured: dict[str, dict],
    full: SyncLinks,
    link_gbps=None,
) -> DeltaSync:
    """`sync.delta` at `sync.delta.density` (`moe_rl.plan.delta`): each stage's bytes as deltas
    (decoder linears as FP8 with `sync.fp8_blocks`, their scales dense; headers per tensor), the
    encode as links of its turn, the kept copies per node; as built (expert owners diff before the
    EP gather, the TP members their share of the rest after a dense TP gather into them; an anchor
    is the full sync with the kept copies following over PCIe), with the owner-side design (TP
    shards diffed before the TP gather: not built; its anchor the full sync) beside it."""
    t, d, fp8 = config.trainer, config.sync.delta, config.sync.fp8_blocks
    wide = encoded_fraction(dtype_bytes, d.density, d.encoding)  # elements in the trainer's precision
    if fp8:
        layer_full, layer_delta = 1 + 4 / fp8**2, encoded_fraction(1, d.density, d.encoding) + 4 / fp8**2
    else:
        layer_full, layer_delta = dtype_bytes, dtype_bytes * wide
    tensors = counts.layer_tensors * (2 if fp8 else 1) + counts.tensors - counts.layer_tensors
    parts = stage_params(config, hf, counts, None)
    measured_rate = measured.get("delta_encode_gb_per_s")
    rate = min(PCIE_GB_PER_S, measured_rate["value"]) if measured_rate else PCIE_GB_PER_S
    per_node = config.cluster.gpus_per_node
    stages, owner_encode, owner_kept = [], [], {}
    for p, (dense, experts, ends) in enumerate(parts):
        owners = Owners.of_stage(p, dense * layer_full + ends * dtype_bytes, experts * layer_full, t)
        headers = HEADER_BYTES * tensors / t.pp
        stages.append(StageBytes(dense * layer_delta + ends * dtype_bytes * wide + headers, experts * layer_delta))
        owner_encode.append(owners.encode_links(per_node, rate))
        for node, nbytes in owners.per_node(per_node).items():
            owner_kept[node] = owner_kept.get(node, 0.0) + nbytes
    quantize = _quantize(config, parts, dtype_bytes, measured, fp8)
    wire = sum(s.total for s in stages)
    # as built: each TP member of a stage's source replica diffs its 1/tp of the non-expert tensors
    # after the (dense) TP gather brought them to it and hands the payloads to the stage source,
    # every expert owner its experts before the EP gather (`sync.owner`); the funnel's root diffs
    # every stage after dense gathers
    dense = wire_stages(config, hf, counts, dtype_bytes, None)
    compare = measured_rate["value"] if measured_rate else None
    if config.sync.stage_groups or t.pp == 1:
        built = [Owners.of_stage(p, full.dense, full.experts, t) for p, full in enumerate(dense)]
        # into the root: the other members' shards of its own 1/tp (dense), their payloads of theirs
        # (an anchor: their whole tensors, handed over dense)
        gathered = [StageBytes(full.dense / t.tp + wire.dense, wire.experts) for full, wire in zip(dense, stages)]
        anchored = [StageBytes(full.dense / t.tp + full.dense, full.experts) for full in dense]
    else:
        built, gathered, anchored = [Owners({0: sum(s.total for s in dense)})], dense, dense
    kept: dict[int, float] = {}
    for owners in built:
        for node, nbytes in owners.per_node(per_node).items():
            kept[node] = kept.get(node, 0.0) + nbytes
    as_built = _links(
        config,
        stages,
        measured,
        quantize,
        encode=[built_encode_links(owners, per_node, compare) for owners in built],
        gathered=gathered,
        link_gbps=link_gbps,
    )
    # as built, an anchor is the full sync with each sending rank's kept copy following over its PCIe
    follow = [
        [Link("kept copy update, PCIe of the busiest sending rank", max(o.shards.values()), PCIE_GB_PER_S)]
        for o in built
    ]
    anchor = _links(config, dense, measured, quantize, encode=follow, gathered=anchored, link_gbps=link_gbps)
    owner_side = _links(config, stages, measured, quantize, encode=owner_encode, link_gbps=link_gbps)
    designs = {"as built": (as_built, anchor, kept), "owner-side": (owner_side, full, owner_kept)}
    delta, owner = (
        DeltaSync(design, d.density, d.encoding, d.full_every, wire, links, anchored.seconds, nodes)
        for design, (links, anchored, nodes) in designs.items()
    )
    if measured_rate:
        where = f"{measured_rate.get('gpu', '?')}, {measured_rate.get('date', '?')}"
        delta.rate = f"PCIe {PCIE_GB_PER_S:g} GB/s modelled, GPU compare measured on {where}"
        owner.rate = f"measured encode on {where}"
    delta.owner_side = owner
    return delta


def _quantize(config: RunConfig, parts, dtype_bytes: int, measured: dict[str, dict], fp8) -> tuple[list, float] | None:
    """(per stage, the full-precision bytes the busiest owner quantizes; the GPU check's rate) where
    it measured one; the root quantizes its stage's decoder dense weights and its own experts."""
    rate = measured.get("fp8_quantize_gb_per_s", {}).get("value") if fp8 else None
    return ([(d + x / config.trainer.ep) * dtype_bytes for d, x, _ in parts], rate) if rate else None


def _links(config: RunConfig, stages, measured, quantize, *, encode=None, gathered=None, link_gbps=None) -> SyncLinks:
    return model_sync(
        stages=stages,
        trainer=config.trainer,
        engines=config.engines,
        cluster=config.cluster,
        stage_groups=config.sync.stage_groups,
        relays=sync_relays(config),
        quantize=quantize[0] if quantize else None,
        quantize_gb_per_s=quantize[1] if quantize else None,
        measured=measured,
        encode=encode,
        gathered=gathered,
        link_gbps=link_gbps,
    )


def sync_relays(config: RunConfig) -> int:
    """`sync.relays` on GPUs: None = every other GPU of the root's node with a NIC."""
    c = config.cluster
    if config.sync.relays is not None:
        return config.sync.relays
    return min(c.gpus_per_node, c.nics_per_node, config.trainer.world_size // config.trainer.pp) - 1


def sync_anchor(hf, counts: ParamCounts) -> str | None:
    """The published sync time of this model (same HF architecture, parameters within 10%), if any."""
    billions = counts.total / 1e9
    for (architecture, size), anchor in SYNC_ANCHORS.items():
        if architecture in (hf.architectures or []) and abs(billions - size) <= 0.1 * size:
            return anchor
    return None


def fp8_sync_bytes(counts: ParamCounts, block: int, dtype_bytes: int) -> int:
    """Bytes of a `sync.fp8_blocks` update: decoder layers at 1 byte a parameter plus a float32
    scale per block x block (their norms and routers, which stay in the trainer's precision, are
    counted as FP8: a small underestimate), embedding and head in the trainer's precision."""
    layers = sum(counts.dense_per_layer) + counts.experts
    return int(layers * (1 + 4 / block**2)) + (counts.embedding + counts.head) * dtype_bytes


def place(config: RunConfig) -> dict[int, list[str]]:
    """Node -> what runs on its GPUs. Raises when an engine would straddle nodes. Colocated
    (`rl.colocate`), engine i shares the GPUs of trainer ranks [i*tp, (i+1)*tp)."""
    cluster, engines = config.cluster, config.engines
    colocated = config.is_rl and config.rl.colocate
    per_node, rows = cluster.gpus_per_node, {n: [] for n in range(cluster.nodes)}
    world = config.trainer.world_size
    for node in range(cluster.nodes):
        lo, hi = node * per_node, min(world, (node + 1) * per_node)
        if lo < hi:
            rows[node].append(f"GPUs {lo - node * per_node}-{hi - 1 - node * per_node}: trainer ranks {lo}-{hi - 1}")
    count = engines.count if config.is_rl else 0
    for i in range(count):
        size = engines.gpus_per_engine
        start = (0 if colocated else world) + i * size
        first, last = start // per_node, (start + size - 1) // per_node
        whole_nodes = size % per_node == 0 and start % per_node == 0
        if first != last and not whole_nodes:
            raise ValueError(
                f"engines: engine {i} (engines.tp={size} GPUs from global GPU {start}) would straddle nodes "
                f"{first} and {last}: make trainer.world_size a multiple of engines.tp, and engines.tp a divisor "
                f"or multiple of cluster.gpus_per_node={per_node}"
            )
        for node in range(first, last + 1):
            lo, hi = max(start, node * per_node), min(start + size, (node + 1) * per_node)
            shared = f", colocated with trainer ranks {lo}-{hi - 1}" if colocated else ""
            rows[node].append(
                f"GPUs {lo - node * per_node}-{hi - 1 - node * per_node}: engine {i} "
                f"(SGLang tp={engines.tp} ep={engines.ep} attn_dp={engines.attn_dp}{shared})"
            )
    used = world if colocated else world + count * engines.gpus_per_engine
    for node in range(cluster.nodes):
        if (node + 1) * per_node > used:
            lo = max(used, node * per_node) - node * per_node
            if lo < per_node:
                rows[node].append(f"GPUs {lo}-{per_node - 1}: idle")
    return rows


def lora_parameters(hf, counts: ParamCounts, rank: int, targets: list[str]) -> tuple[int, int]:
    """(dense, routed-expert) adapter parameters of the whole model for these Megatron targets."""
    from parallel.bridges import bridge_for

    text = hf.get_text_config()
    h, heads = text.hidden_size, text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or h // heads
    mla = getattr(text, "kv_lora_rank", None) is not None
    attention = 0
    if "linear_qkv" in targets and not mla:
        attention += rank * (h + (heads + 2 * text.num_key_value_heads) * head_dim)
    if mla:  # each adapter: rank * (in + out) of its projection
        q_head = text.qk_nope_head_dim + text.qk_rope_head_dim
        q_lora, kv_lora = getattr(text, "q_lora_rank", None), text.kv_lora_rank
        shapes = {
            "linear_kv_down_proj": (h, kv_lora + text.qk_rope_head_dim),
            "linear_kv_up_proj": (kv_lora, heads * (text.qk_nope_head_dim + text.v_head_dim)),
            **(
                {"linear_q_proj": (h, heads * q_head)}
                if q_lora is None
                else {"linear_q_down_proj": (h, q_lora), "linear_q_up_proj": (q_lora, heads * q_head)}
            ),
        }
        attention += sum(rank * (i + o) for name, (i, o) in shapes.items() if name in targets)
    if "linear_proj" in targets:
        attention += rank * ((heads * (text.v_head_dim if mla else head_dim)) + h)

    def mlp(f: int) -> int:
        return rank * ((h + 2 * f) * ("linear_fc1" in targets) + (f + h) * ("linear_fc2" in targets))

    experts = bridge_for(hf).num_experts
    routed_f = getattr(text, "moe_intermediate_size", None) or text.intermediate_size
    shared_f = (getattr(text, "n_shared_experts", 0) or 0) * routed_f or getattr(
        text, "shared_expert_intermediate_size", 0
    )
    dense = expert = 0
    for layer_experts in counts.expert_per_layer:
        dense += attention
        if layer_experts:
            expert += experts * mlp(routed_f)
            dense += mlp(shared_f) if shared_f else 0
        else:
            dense += mlp(text.intermediate_size)
    return dense, expert


def trainer_memory(
    config: RunConfig, hf, counts: ParamCounts, dtype_bytes: int, adapter: tuple[int, int] | None = None
) -> tuple[int, dict[str, float]]:
    """(worst stage, GB per GPU by component); raises when it exceeds the GPU. `dtype_bytes`: of
    trainer.precision. `adapter`: LoRA's (dense, expert) parameters, the only ones with gradients
    and optimizer state."""
    t = config.trainer
    layers_per_stage = hf.num_hidden_layers // t.pp
    s, b, h = config.data.seq_length, t.micro_batch_size, hf.hidden_size
    if t.max_tokens_per_microbatch is not None:  # a micro-batch computes at most the budget's tokens
        s, b = t.max_tokens_per_microbatch, 1
    s = s / t.cp  # each CP rank holds 1/cp of a micro-batch's tokens (the budget counts them before the split)
    per_layer = [
        _activation_bytes(hf, s, b, moe=counts.expert_per_layer[i] > 0) * dtype_bytes / 2 / t.tp
        for i in range(hf.num_hidden_layers)
    ]
    adam = 8 if dtype_bytes == 4 else 12  # m, v; + the fp32 main params of a 16-bit model
    worst = (0, {}, -1.0)
    for p in range(t.pp):
        layers = range(p * layers_per_stage, (p + 1) * layers_per_stage)
        dense = (
            sum(counts.dense_per_layer[i] for i in layers)
            + (counts.embedding if p == 0 else 0)
            + (counts.head if p == t.pp - 1 else 0)
        )
        pd, pe = dense / t.tp, sum(counts.expert_per_layer[i] for i in layers) / (t.expert_tp * t.ep)
        # trained parameters: everything, or with LoRA this stage's share of the adapters
        td, te = (pd, pe) if adapter is None else (adapter[0] / t.pp / t.tp, adapter[1] / t.pp / (t.expert_tp * t.ep))
        # the distributed optimizer shards dense state over DP x CP (megatron's dp-cp group), experts' over EDP
        optimizer = adam * (td / (t.dp * t.cp) + te / t.expert_dp) if t.optimizer.distributed else adam * (td + te)
        in_flight = min(t.pp - p, t.num_microbatches)
        if t.recompute:
            acts = in_flight * len(layers) * dtype_bytes * s * b * h / t.tp + max(per_layer[i] for i in layers)
        else:
            acts = in_flight * sum(per_layer[i] for i in layers)
        if p == t.pp - 1:
            acts += 4 * s * b * hf.vocab_size / t.tp
        memory = {
            "weights": dtype_bytes * (pd + pe + (0 if adapter is None else td + te)) / GB,
            "grads": 4 * (td + te) / GB,
            "optimizer": optimizer / GB,
            "activations": acts / GB,
        }
        if config.is_rl and adapter is None:  # a stage source's two buckets (a relay holds one)
            memory["sync buffers"] = 2 * config.sync.bucket_bytes / GB
        if config.is_rl and config.algorithm.needs_reference and adapter is None:  # LoRA: the base, adapters off
            memory["reference"] = dtype_bytes * (pd + pe) / GB
        memory["total"] = sum(memory.values())
        if memory["total"] > worst[2]:
            worst = (p, memory, memory["total"])
    stage, memory, total = worst
    if total > config.cluster.gpu_memory_gb:
        raise ValueError(
            f"trainer: ~{total:.0f} GB per GPU on pipeline stage {stage} (weights {memory['weights']:.0f}, grads "
            f"{memory['grads']:.0f}, optimizer {memory['optimizer']:.0f}, activations {memory['activations']:.0f}) "
            f"exceeds cluster.gpu_memory_gb={config.cluster.gpu_memory_gb:g}: raise trainer.ep/pp/tp or world_size, "
            "set trainer.optimizer.distributed: true or trainer.recompute: true, lower micro_batch_size "
            "(trainer.max_tokens_per_microbatch when set), or for long sequences raise trainer.cp (activations / cp)"
        )
    return stage, memory


def _activation_bytes(hf, s: int, b: int, *, moe: bool) -> float:
    h = hf.hidden_size
    attention = 15 * s * b * h
    if not moe:
        return attention + 2 * s * b * h + 6 * s * b * hf.intermediate_size
    f_expert = getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size
    shared = (getattr(hf, "n_shared_experts", None) or 0) * f_expert
    mlp = 2 * s * b * h + hf.num_experts_per_tok * (2 * s * b * h + 6 * s * b * f_expert)
    if shared:
        mlp += 2 * s * b * h + 6 * s * b * shared
    return attention + mlp


def engine_memory(config: RunConfig, hf, counts: ParamCounts, dtype_bytes: int) -> dict[str, float]:
    e, gpu, fp8 = config.engines, config.cluster.gpu_memory_gb, config.sync.fp8_blocks
    layer_bytes = 1 + 4 / fp8**2 if fp8 and config.lora is None else dtype_bytes  # FP8 engines: the sync's format

    def per_gpu(dense: float, experts: int) -> float:  # dense split over attention TP, experts over the engine
        return (dense / (e.tp // e.attn_dp) + experts * layer_bytes / e.tp) / GB

    ends = counts.embedding + counts.head
    weights = per_gpu((counts.total - counts.experts - ends) * layer_bytes + ends * dtype_bytes, counts.experts)
    memory = {"weights": weights}
    if e.speculative is not None:  # SGLang NEXTN: the MTP layer is a draft model of its own
        draft_dense, draft_experts = draft_parameters(hf, counts)
        memory["draft (MTP)"] = per_gpu(draft_dense * layer_bytes, draft_experts)
    memory["sync buffer"] = config.sync.bucket_bytes / GB if config.lora is None else 0.0  # every TP rank: every bucket
    kv_cache = e.mem_fraction_static * gpu - sum(memory.values())
    if kv_cache <= 0:
        raise ValueError(
            f"engines: ~{weights:.0f} GB of weights per GPU exceed engines.mem_fraction_static x "
            f"cluster.gpu_memory_gb = {e.mem_fraction_static * gpu:.0f} GB: raise engines.tp (GPUs per engine) "
            f"or lower engines.attn_dp"
        )
    return {**memory, "kv_cache": kv_cache}


def draft_parameters(hf, counts: ParamCounts) -> tuple[int, int]:
    """(dense, expert) parameters of a NEXTN draft, DeepSeek-V3's MTP module as SGLang loads it: one
    decoder layer like the last, its `eh_proj` [hidden, 2 hidden] and two norms; the embedding and
    the head are the target's. Transformers' models hold no MTP layer, so the counts have none."""
    hidden = hf.get_text_config().hidden_size
    return counts.dense_per_layer[-1] + 2 * hidden * hidden + 2 * hidden, counts.expert_per_layer[-1]


def _check_engine_model(config: RunConfig, hf) -> None:
    from parallel.bridges import bridge_for

    e, shape = config.engines, bridge_for(hf).model_shape()
    if not config.is_rl:
        return
    attention_tp = e.tp // e.attn_dp
    if shape.num_attention_heads % attention_tp:
        raise ValueError(
            f"engines.tp/engines.attn_dp={attention_tp} does not divide the model's "
            f"{shape.num_attention_heads} attention heads: change engines.tp or engines.attn_dp"
        )
    if shape.num_experts and shape.num_experts % e.ep:
        raise ValueError(f"engines.ep={e.ep} does not divide the model's {shape.num_experts} experts: choose a divisor")
