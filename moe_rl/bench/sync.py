"""`moe-rl bench sync CONFIG` (options: `moe_rl.bench.options.SyncBench`): full weight sync of a
real Megatron export vs a raw broadcast.

Trainer: a Megatron GPTModel (random init) built from `model` (Qwen3MoeConfig fields) on a gloo
world of `layout.world_size` ranks (`parallel.world.spawn`); rank 0 owns the `WeightSender`, the
others exhaust the export. Full = export (TP/EP gathers) + pack + broadcast + engines verify the
checksum, stage into their reused storage and commit. Engines: `num_engines` receiver-only
engines (`sync.receiver_engine`: a `WeightReceiver` behind SGLang's weight routes, no model; not
the embedded engine, whose commit rebuilds a transformers model, which is model loading, not
transfer). Raw = one flat uint8 tensor of the same byte
count broadcast over the same group into a preallocated buffer. Two warm-up syncs (both storage
sets of every engine) and one raw broadcast come first; then `repeats` timed pairs.

Each timed repeat runs, in order: export only (iterate the export, drop every tensor), export +
pack (the sender's packer, then each bucket's checksum, nothing sent; the export's and the
checksums' time inside it clocked apart), the full sync, the raw broadcast. Reports every time,
the best of the repeats (pack = best export+pack - best export, the checksums included),
GB/s, the ratio raw/full, and the source rank's peak extra memory against the bound 2 x
bucket_bytes + the largest tensor: the sender's two bucket buffers (allocated once) plus the
peak RSS growth during the sync (VmHWM reset through /proc/self/clear_refs: the kernel's exact
peak, which sees torch's allocations where tracemalloc cannot).

CPU seconds per stage, next to wall seconds (medians over the repeats, summed over every
process: trainer ranks and receivers; `time.process_time`, all threads): export (the gathers),
pack (copies into buckets), hash (the checksums), broadcast (the raw broadcast's), receive (what
the full sync costs the receivers beyond the raw broadcast: checksum checks, staging, commit;
no wall time of its own, it overlaps the broadcast), full (the whole sync).
`cpu_busy` = CPU seconds / (wall seconds x the machine's cores): near 1, the sync is bound by
the cores, and no overlap of its stages can shorten it.

Bytes per link (measured: `sync.traffic` and `parallel.gathers.GATHER_BYTES`, counted where each
transfer starts, over the last full sync): per trainer rank sent and received over the export's
gathers, the funnel and the weight-update groups, per engine rank received; and the largest number
of bytes any trainer rank sends, the figure `moe-rl plan`'s link model turns into seconds. With
`layout.pp` > 1 each stage sends its own layers over its own group (`sync.stages`), or with
`stage_groups: false` through the funnel (`sync.pipeline`); the raw broadcast stays one group's.

CONFIG (YAML): the `SyncBench` fields; example: configs/bench/sync_1g.yaml. With a `lora:` section
(LoRAConfig fields) it compares adapter and full-weight syncs instead (`moe_rl.bench.lora`,
configs/bench/sync_lora.yaml).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from pathlib import Path

import torch

from moe_rl.bench.options import SyncBench
from parallel.bridges import bridge_for
from parallel.export import export_hf_weights, export_source_ranks
from parallel.gathers import GATHER_BYTES
from parallel.model import build_gpt_model, init_model_parallel
from parallel.world import spawn
from sync import traffic
from sync.bucket import checksum
from sync.config import SyncConfig
from sync.engine_set import SyncError, describe
from sync.receiver_engine import ReceiverEngineClient, start_receiver_engine
from sync.sender import exhaust
from sync.shapes import SyncSetup, make_syncer
from sync.syncer import ViaCoordinator


def _memory_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _trainer(options: SyncBench, ports: list[int]) -> dict | None:
    """Rank function: build this rank's Megatron stage; the first stage's source syncs (each stage's
    source sends its own layers, or funnels them), the others run their exports."""
    # heavy: transformers, only where an HF config, model or tokenizer is read
    from transformers import Qwen3MoeConfig

    layout = options.layout
    bridge = bridge_for(Qwen3MoeConfig(**options.model))
    init_model_parallel(layout, seed=0)
    model = build_gpt_model(bridge, layout)
    export_bytes, repeats = options.export_bucket_mb << 20, options.repeats
    bucket_bytes = options.bucket_mb << 20
    sources = export_source_ranks()
    staged = layout.pp > 1 and options.stage_groups
    config = SyncConfig(bucket_bytes=bucket_bytes, backend="gloo", timeout_s=600, stage_groups=staged)
    engines = [ReceiverEngineClient(port, f"bench-engine-{i}", timeout_s=600) for i, port in enumerate(ports)]
    syncer = make_syncer(engines, SyncSetup(config, sources))
    assert isinstance(syncer, ViaCoordinator)  # full weights: the coordinator's sender
    sender = syncer.sender
    largest = [0]

    def stream():
        for name, tensor in export_hf_weights(model, bridge, bucket_bytes=export_bytes):
            largest[0] = max(largest[0], tensor.numel() * tensor.element_size())
            yield name, tensor

    def full(version: int):
        """One full sync, collective over the trainer world; the sender's stats on the coordinator."""
        return syncer.update(stream(), version)

    if sender is None:  # 2 warm-up syncs, then per repeat the exports of STAGES (CPU seconds of each)
        for version in (1, 2):
            full(version)
        cpu = []
        for version in range(3, 3 + repeats):
            spent = {}
            for stage in STAGES:
                if stage == "full":
                    before, gathered = traffic.snapshot(), dict(GATHER_BYTES)
                spent[stage] = _cpu(lambda: full(version) if stage == "full" else exhaust(stream()))
                if stage == "full":
                    links = _link_bytes(before, gathered)
            cpu.append(spent)
        syncer.close()
        # heavy: megatron-core, loaded where a model is built (it is, above)
        from megatron.core import parallel_state as ps

        return {"cpu": cpu, "links": links, "stage": ps.get_pipeline_model_parallel_rank()}
    times = {key: [] for key in ("export", "export_pack", "full", "raw")}
    transient = {"export_pack": 0, "full": 0}
    walls, cpu = [], []  # per repeat: {stage: wall seconds}, {stage: (this rank's CPU s, the receivers')}
    try:
        for version in (1, 2):  # warm-up: the group, both storage sets of every engine, page faults
            nbytes = full(version).bytes
        flat = torch.zeros(nbytes, dtype=torch.uint8)
        _raw_broadcast(sender, flat)
        packer = sender.transport.packer
        for version in range(3, 3 + repeats):
            wall, grown, spent = {}, {}, {}
            inside = {"export": [0.0, 0.0], "hash": [0.0, 0.0]}  # [wall s, CPU s] within the pack stage

            def pack() -> None:  # export + pack, each bucket's checksum timed apart (nothing sent)
                packer.checksums = False
                for bucket in packer.pack(_clocked(stream(), inside["export"])):
                    wall_start, cpu_start = time.perf_counter(), time.process_time()
                    checksum(bucket.data)
                    inside["hash"][0] += time.perf_counter() - wall_start
                    inside["hash"][1] += time.process_time() - cpu_start
                packer.checksums = True

            work = {
                "export": lambda: exhaust(stream()),
                "pack": pack,
                "full": lambda: full(version),
                "raw": lambda: _raw_broadcast(sender, flat),
            }
            for stage in (*STAGES, "raw"):
                if stage == "full":  # the last full sync's bytes per link, here and at every engine rank
                    before, gathered = traffic.snapshot(), dict(GATHER_BYTES)
                    received = [e.traffic() for e in engines]
                wall[stage], grown[stage], spent[stage] = _measured(work[stage], engines)
                if stage == "full":
                    links = _link_bytes(before, gathered)
                    engine_links = [traffic.since(was, e.traffic())["received"] for was, e in zip(received, engines)]
            (export_wall, export_cpu), (hash_wall, hash_cpu) = inside["export"], inside["hash"]
            wall["hash"], spent["hash"] = hash_wall, (hash_cpu, 0.0)
            wall["pack"] -= export_wall + hash_wall  # the packer's own copies
            spent["pack"] = (spent["pack"][0] - export_cpu - hash_cpu, spent["pack"][1])
            walls.append(wall)
            cpu.append(spent)
            times["export"].append(wall["export"])
            times["export_pack"].append(wall["export"] + wall["pack"] + wall["hash"])
            times["full"].append(wall["full"])
            times["raw"].append(wall["raw"])
            transient["export_pack"] = max(transient["export_pack"], grown["pack"])
            transient["full"] = max(transient["full"], grown["full"])
    finally:
        syncer.close()
    best = {key: min(values) for key, values in times.items()}
    ratios = [raw / full for full, raw in zip(times["full"], times["raw"])]
    buffers, bound = 2 * bucket_bytes, 2 * bucket_bytes + largest[0]
    return dict(
        bytes=nbytes,
        num_engines=len(engines),
        layout=dataclasses.asdict(layout),
        bucket_bytes=bucket_bytes,
        export_bucket_bytes=export_bytes,
        export_seconds=times["export"],
        export_pack_seconds=times["export_pack"],
        full_seconds=times["full"],
        raw_seconds=times["raw"],
        best_export_s=best["export"],
        best_pack_s=best["export_pack"] - best["export"],
        best_full_s=best["full"],
        best_raw_s=best["raw"],
        best_full_gb_per_s=nbytes / best["full"] / 1e9,
        best_raw_gb_per_s=nbytes / best["raw"] / 1e9,
        ratio_raw_over_full=ratios,
        ratio_best=best["raw"] / best["full"],
        largest_tensor_bytes=largest[0],
        sender_buffer_bytes=buffers,
        peak_transient_bytes_export_pack=transient["export_pack"],
        peak_transient_bytes_full=transient["full"],
        peak_extra_bytes_source=buffers + transient["full"],
        bound_bytes=bound,
        peak_extra_within_bound=buffers + transient["full"] <= bound,
        stream="Megatron export (parallel.export.export_hf_weights), random init",
        engines="receiver-only engines (sync.receiver_engine: WeightReceiver over HTTP, no model)",
        walls=walls,
        cpu=cpu,
        links=links,
        engine_links=engine_links,
        stage=0,
        stage_groups=staged,
    )


STAGES = ("export", "pack", "full")
"""The timed stages of a repeat, each an export on every trainer rank; then the raw broadcast."""


def _clocked(items, clock: list[float]):
    """`items`, adding to `clock` [wall s, CPU s] the time spent producing each one."""
    items = iter(items)
    while True:
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            item = next(items)
        except StopIteration:
            return
        finally:
            clock[0] += time.perf_counter() - wall
            clock[1] += time.process_time() - cpu
        yield item


def _link_bytes(before: dict, gathered: dict) -> dict[str, dict[str, int]]:
    """{"sent" | "received": {link: bytes}} of this rank since `before` (`sync.traffic`) and
    `gathered` (`parallel.gathers.GATHER_BYTES`): the weight-update groups, the funnel, the gathers."""
    moved = traffic.since(before)
    for way in ("sent", "received"):
        if n := GATHER_BYTES[way] - gathered[way]:
            moved[way]["gather"] = n
    return moved


def link_table(ranks: list[dict]) -> dict:
    """Bytes per link of the last full sync (measured): per trainer rank, per engine rank, and the
    largest number any trainer rank sends."""
    trainer = [{"rank": i, "stage": r["stage"], **r["links"]} for i, r in enumerate(ranks)]
    return {
        "trainer": trainer,
        "engines": ranks[0]["engine_links"],
        "max_sent_by_a_trainer_rank": max(sum(r["sent"].values()) for r in trainer),
        "max_received_by_a_trainer_rank": max(sum(r["received"].values()) for r in trainer),
    }


def _cpu(work) -> float:
    start = time.process_time()
    work()
    return time.process_time() - start


def _measured(work, engines: list[ReceiverEngineClient]) -> tuple[float, int, tuple[float, float]]:
    """Wall seconds and peak RSS growth of `work()` (`_timed`), and the CPU seconds it cost this
    process and, summed, the receivers."""
    before = sum(e.cpu_seconds() for e in engines)
    start = time.process_time()
    seconds, grown = _timed(work)
    here = time.process_time() - start
    return seconds, grown, (here, sum(e.cpu_seconds() for e in engines) - before)


def cpu_breakdown(source: dict, others: list[dict]) -> dict[str, dict[str, float]]:
    """{stage: wall s, CPU s over every process, cpu_busy} (medians over the repeats) from the
    source rank's result and the other trainer ranks' per-stage CPU seconds."""
    cores = len(os.sched_getaffinity(0))
    rows = {stage: [] for stage in ("export", "pack", "hash", "broadcast", "receive", "full")}
    for repeat, (wall, spent) in enumerate(zip(source["walls"], source["cpu"])):

        def total(stage: str) -> float:
            here, receivers = spent[stage]
            return here + receivers + sum(other["cpu"][repeat].get(stage, 0.0) for other in others)

        rows["export"].append((wall["export"], total("export")))
        rows["pack"].append((wall["pack"], spent["pack"][0]))  # the source's packer
        rows["hash"].append((wall["hash"], spent["hash"][0]))
        rows["broadcast"].append((wall["raw"], total("raw")))
        rows["receive"].append((float("nan"), spent["full"][1] - spent["raw"][1]))  # overlaps the broadcast
        rows["full"].append((wall["full"], total("full")))
    out = {}
    for stage, values in rows.items():
        wall, cpu = statistics.median(v[0] for v in values), statistics.median(v[1] for v in values)
        busy = cpu / (wall * cores) if wall > 0 else float("nan")
        out[stage] = {"wall_s": wall, "cpu_s": cpu, "cpu_busy": busy}
    return out


def _timed(work) -> tuple[float, int]:
    """Seconds `work()` took and the peak RSS growth of this process meanwhile (VmHWM after
    resetting it via /proc/self/clear_refs: the kernel's exact peak, which sees torch's
    allocations that tracemalloc cannot; freed tensors above glibc's mmap threshold leave RSS)."""
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS mark
    before = _memory_kb("VmRSS")
    start = time.perf_counter()
    work()
    return time.perf_counter() - start, max(0, _memory_kb("VmHWM") - before) << 10


def _raw_broadcast(sender, flat: torch.Tensor) -> float:
    """One broadcast of `flat` over the sender's group; the engines receive it in parallel."""
    start = time.perf_counter()
    name = sender.transport.config.group_name  # the first stage's group, with stage groups
    receives = sender.engines.submit(lambda engine: engine.raw_receive(flat.numel(), name))
    sender.transport.group.broadcast(flat)
    if failed := sender.engines.wait(receives):
        raise SyncError(f"raw broadcast: {describe(failed)}")
    return time.perf_counter() - start


def run(options: SyncBench) -> dict:
    """The source rank's figures, with every process's CPU seconds per stage and the bytes per link;
    written to `options.output_path`."""
    procs, ports = zip(*[start_receiver_engine(timeout_s=600) for _ in range(options.num_engines)])
    try:
        # fresh ranks: forked ones would count copy-on-write faults of the preloaded modules as peak memory
        ranks = spawn(_trainer, options.layout.world_size, options, list(ports), timeout_s=3600, fresh=True)
    finally:
        for proc in procs:
            proc.kill()
            proc.join(30)
    result = ranks[0]
    result["cpu_by_stage"] = cpu_breakdown(result, ranks[1:])
    result["bytes_per_link"] = link_table(ranks)
    for key in ("links", "engine_links", "stage"):
        result.pop(key)
    Path(options.output_path).write_text(json.dumps(result, indent=2))
    return result


def show(result: dict, output: str) -> None:
    """The figures, CPU per stage and bytes per link, as printed lines."""
    for key, value in result.items():
        if key in ("walls", "cpu", "cpu_by_stage", "bytes_per_link"):
            continue
        shown = (
            [round(v, 3) for v in value] if isinstance(value, list) and value and isinstance(value[0], float) else value
        )
        print(f"{key:>42}: {shown:.4g}" if isinstance(shown, float) else f"{key:>42}: {shown}")
    print(f"{'stage':>10} {'wall s':>8} {'CPU s':>8} {'CPU busy':>9}   (CPU: every process; busy: CPU / wall / cores)")
    for stage, row in result["cpu_by_stage"].items():
        print(f"{stage:>10} {row['wall_s']:8.3f} {row['cpu_s']:8.3f} {row['cpu_busy']:9.2f}")
    links = result["bytes_per_link"]
    print("bytes per link, last full sync (measured: counted where each transfer starts):")
    for row in links["trainer"]:
        print(f"  trainer rank {row['rank']} (stage {row['stage']}): sent {row['sent']}  received {row['received']}")
    for i, row in enumerate(links["engines"]):
        print(f"  engine rank {i}: received {row}")
    print(f"  largest sent by one trainer rank: {links['max_sent_by_a_trainer_rank']} bytes")
    print(f"wrote {output}")
