"""Per-stage weight-update groups (`sync.stages`): PP2 trainer worlds, each stage's source broadcasting
its own layers over its own group, into receiver-only engines that join both groups. Every engine serves
exactly the HF checkpoint (both stages' layers) after each version, and the byte counters show
that no trainer rank receives another stage's tensors (the funnel, for contrast, does)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from parallel.layout import ParallelLayout
from parallel.world import spawn
from tests.sync.conftest import tiny_qwen3_moe_config
from tests.sync.test_sync_broadcast import assert_same

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)


def rank_setup(hf_dir: str, ports: list[int], layout: ParallelLayout):
    """On a rank: the bridge, the Megatron model holding the HF weights, the stage sources and a
    client per receiver engine."""
    from parallel.bridges import bridge_for
    from parallel.export import export_source_ranks
    from parallel.hf_import import load_hf_weights
    from parallel.model import build_gpt_model, init_model_parallel
    from sync.receiver_engine import ReceiverEngineClient

    bridge = bridge_for(json.loads((Path(hf_dir) / "config.json").read_text()))
    init_model_parallel(layout, seed=1234)
    model = build_gpt_model(bridge, layout)
    load_hf_weights(model, bridge, hf_dir)
    clients = [ReceiverEngineClient(port, name=f"engine-{i}") for i, port in enumerate(ports)]
    return bridge, model, export_source_ranks(), clients


def staged_sync(
    hf_dir: str, ports: list[int], out_dir: str, layout: ParallelLayout, stage_groups: bool, relays: int = 0
) -> dict:
    """Rank function: import the HF weights, send versions 1 and 2 (weights x version) per stage
    (or through the funnel), each stage source with `relays` ranks of its stage behind it;
    returns this rank's byte counters and what its own stage exported."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from parallel.export import export_hf_weights
    from parallel.gathers import GATHER_BYTES
    from sync import traffic
    from sync.config import SyncConfig
    from sync.pipeline import stage_stream, sync_source
    from sync.sender import WeightSender, exhaust
    from sync.stages import StagedSync

    bridge, model, sources, clients = rank_setup(hf_dir, ports, layout)
    config = SyncConfig(bucket_bytes=16384, timeout_s=60)
    rank = dist.get_rank()
    if stage_groups:
        per_stage = layout.world_size // layout.pp  # ranks of a stage, the source first
        behind = {stage: list(range(src + 1, src + 1 + relays)) for stage, src in sources.items()}
        assert all(r < (stage + 1) * per_stage for stage, rs in behind.items() for r in rs)
        sync = StagedSync(clients, config, sources, relays=behind)
    else:
        sender = WeightSender(clients, config) if rank == sync_source(sources) else None
    exported = [0]

    def own_stage():  # what this rank's own stage yields here (nothing off the stage sources)
        for name, tensor in export_hf_weights(model, bridge, bucket_bytes=16384):
            exported[0] += tensor.numel() * tensor.element_size()
            yield name, tensor

    before, gathered = traffic.snapshot(), dict(GATHER_BYTES)
    served = []  # on stage sources: what the engines serve when this rank's update returns
    for version in (1, 2):
        exported[0] = 0
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(version / (version - 1) if version > 1 else 1)
        if stage_groups:
            stats = sync.update(own_stage(), version)
            if rank in sources.values():
                served.append([client.served_version() for client in clients])
        else:
            stream = stage_stream(own_stage(), sources)
            stats = sender.update(stream, version) if sender is not None else exhaust(stream)
        if stats is not None:
            for i, client in enumerate(clients):
                client.dump_weights(f"{out_dir}/engine{i}-v{version}.safetensors")
        dist.barrier()
    moved = traffic.since(before)
    if stage_groups:
        sync.close()
    elif sender is not None:
        sender.close()
    return {
        "rank": rank,
        "stage": ps.get_pipeline_model_parallel_rank(),
        "source": rank in sources.values(),
        "exported": exported[0],  # the last version's, this rank's own stage
        "sent": moved["sent"],
        "received": moved["received"],
        "gather_received": (GATHER_BYTES["received"] - gathered["received"]) // 2,  # per version
        "committed": None if stats is None else stats.version,
        "served": served,
        "relayed": None if not stage_groups or sync.relay is None else sync.relay.buckets,
    }


@pytest.mark.parametrize(
    "layout",
    [ParallelLayout(world_size=2, pp=2), ParallelLayout(world_size=4, pp=2, ep=2)],
    ids=["pp2", "pp2-ep2"],
)
def test_each_stage_broadcasts_its_own_layers_exactly(engines, tmp_path, layout):
    from transformers import Qwen3MoeForCausalLM

    clients, _ = engines
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(tiny_qwen3_moe_config()).save_pretrained(tmp_path / "hf")
    ports = [int(c.url.rsplit(":", 1)[1]) for c in clients]
    ranks = spawn(staged_sync, layout.world_size, str(tmp_path / "hf"), ports, str(tmp_path), layout, True)
    assert [r["committed"] for r in ranks] == [2] + [None] * (layout.world_size - 1)
    # a stage source returns from an update only after the commit (else, leaving its group at
    # shutdown, it could drop the version the engines still hold uncommitted)
    for r in ranks:
        assert r["served"] == ([[1] * len(clients), [2] * len(clients)] if r["source"] else []), r
    checkpoint = load_file(tmp_path / "hf" / "model.safetensors")
    for version in (1, 2):
        want = {name: tensor * version for name, tensor in checkpoint.items()}
        for i in range(len(clients)):
            assert_same(load_file(tmp_path / f"engine{i}-v{version}.safetensors"), want)
    # byte counters: each stage source broadcasts exactly its own stage's bytes (2 versions) and
    # receives nothing but its own stage's gathers; nobody receives over a funnel
    sources = [r for r in ranks if r["source"]]
    assert len(sources) == 2 and {r["stage"] for r in sources} == {0, 1}
    total = sum(r["exported"] for r in sources)
    assert total == sum(t.numel() * t.element_size() for t in checkpoint.values())
    for r in ranks:
        assert "funnel" not in r["received"] and "funnel" not in r["sent"], r
        assert r["received"].get("broadcast", 0) == 0, r  # trainer ranks only send over the groups
        assert r["gather_received"] <= r["exported"], r  # its own stage's gathers, no more
        if r["source"]:
            assert r["sent"]["broadcast"] == 2 * r["exported"], r
            assert r["exported"] < total, r
    # the largest number of bytes any trainer rank sends: the larger stage, not the model
    assert max(r["sent"].get("broadcast", 0) for r in ranks) == 2 * max(r["exported"] for r in sources)


def test_the_funnel_receives_the_other_stages_bytes(engines, tmp_path):
    """The contrast, same counters: with `stage_groups: false` the first stage's source receives
    stage 1's tensors and broadcasts the whole model."""
    from transformers import Qwen3MoeForCausalLM

    clients, _ = engines
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(tiny_qwen3_moe_config()).save_pretrained(tmp_path / "hf")
    ports = [int(c.url.rsplit(":", 1)[1]) for c in clients]
    layout = ParallelLayout(world_size=2, pp=2)
    ranks = spawn(staged_sync, 2, str(tmp_path / "hf"), ports, str(tmp_path), layout, False)
    first, second = sorted(ranks, key=lambda r: r["stage"])
    assert first["received"]["funnel"] == 2 * second["exported"] == second["sent"]["funnel"]
    assert first["sent"]["broadcast"] == 2 * (first["exported"] + second["exported"])


def test_relays_take_every_bucket_behind_each_stage_source(engines, tmp_path):
    """PP2 x DP2: each stage source with its stage's other rank as relay (group ranks 0, 1; the
    engines from rank_offset 2): the engines still get every tensor bit for bit, each relay
    receives exactly what its stage's source sends, and the sources send nothing more."""
    from transformers import Qwen3MoeForCausalLM

    clients, _ = engines
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(tiny_qwen3_moe_config()).save_pretrained(tmp_path / "hf")
    ports = [int(c.url.rsplit(":", 1)[1]) for c in clients]
    layout = ParallelLayout(world_size=4, pp=2)
    ranks = spawn(staged_sync, 4, str(tmp_path / "hf"), ports, str(tmp_path), layout, True, 1)
    checkpoint = load_file(tmp_path / "hf" / "model.safetensors")
    for version in (1, 2):
        want = {name: tensor * version for name, tensor in checkpoint.items()}
        for i in range(len(clients)):
            assert_same(load_file(tmp_path / f"engine{i}-v{version}.safetensors"), want)
    by_rank = {r["rank"]: r for r in ranks}
    for source, relay in ((0, 1), (2, 3)):
        sent = by_rank[source]["sent"]["broadcast"]
        assert sent == 2 * by_rank[source]["exported"], by_rank[source]
        assert by_rank[relay]["received"] == {"broadcast": sent} and by_rank[relay]["relayed"] > 0, by_rank[relay]
        assert by_rank[relay]["sent"] == {}, by_rank[relay]


def staged_delta_sync(hf_dir: str, ports: list[int], out_dir: str, layout: ParallelLayout) -> dict:
    """Rank function: per-stage groups with `sync.delta`: version 1 (the anchor), 2 (every weight
    doubled: dense payloads) and 3 (one element of each parameter moved: sparse payloads); each
    stage source returns what its stage exported last and the coordinator each version's stats."""
    import torch.distributed as dist

    from parallel.export import export_hf_weights
    from sync.config import DeltaConfig, SyncConfig
    from sync.stages import StagedSync

    bridge, model, sources, clients = rank_setup(hf_dir, ports, layout)
    sync = StagedSync(clients, SyncConfig(bucket_bytes=16384, timeout_s=60, delta=DeltaConfig(enabled=True)), sources)
    exported, stats = {}, []

    def own_stage():
        for name, tensor in export_hf_weights(model, bridge, bucket_bytes=16384):
            exported[name] = tensor.clone()
            yield name, tensor

    for version in (1, 2, 3):
        with torch.no_grad():
            for param in model.parameters():
                if version == 2:
                    param.mul_(2)
                elif version == 3:
                    param.view(-1)[0] += 0.5
        result = sync.update(own_stage(), version)
        if result is not None:
            stats.append((result.delta.anchor, result.bytes, result.delta.dense_bytes))
            for i, client in enumerate(clients):
                client.dump_weights(f"{out_dir}/engine{i}-v{version}.safetensors")
        dist.barrier()
    sync.close()
    return {"source": dist.get_rank() in sources.values(), "exported": exported, "stats": stats}


def test_each_stage_sends_deltas_of_its_own_layers(engines, tmp_path):
    """`sync.delta` over per-stage groups: each stage source keeps and diffs only its own stage's
    bytes; the engines serve exactly what the stages exported at every version."""
    from transformers import Qwen3MoeForCausalLM

    clients, _ = engines
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(tiny_qwen3_moe_config()).save_pretrained(tmp_path / "hf")
    ports = [int(c.url.rsplit(":", 1)[1]) for c in clients]
    layout = ParallelLayout(world_size=2, pp=2)
    ranks = spawn(staged_delta_sync, 2, str(tmp_path / "hf"), ports, str(tmp_path), layout)
    want = {name: t for r in ranks if r["source"] for name, t in r["exported"].items()}
    assert len(want) == len(load_file(tmp_path / "hf" / "model.safetensors"))
    for i in range(len(clients)):
        assert_same(load_file(tmp_path / f"engine{i}-v3.safetensors"), want)
    (stats,) = [r["stats"] for r in ranks if r["stats"]]
    assert [anchor for anchor, _, _ in stats] == [True, False, False]
    _, sparse_bytes, _ = stats[2]
    _, dense_bytes, _ = stats[0]  # the anchor: every stage's bytes as they are
    assert sparse_bytes < 0.2 * dense_bytes  # one element per parameter moved: headers, a few values
