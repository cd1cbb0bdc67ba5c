"""Owner-side diffs (`sync.owner`): EP2, PP2 x EP2, TP2 and TP2 x EP2 gloo worlds of the tiny
Qwen3-MoE send a chain of versions with `sync.delta` into receiver-only engines, each expert owner
encoding its own experts before the EP gather and each TP member the dense tensors it diff-owns.
After every version each engine serves exactly what a plain (dense) export of the same weights
yields; on a delta the EP gather carries payloads (a fraction of the dense bytes, at least the
other owners' payloads), on an anchor the dense bytes; an owner whose kept copy was invalidated
sends dense payloads and the result is still exact. Each TP member keeps its share of the dense
tensors and the stage source no tensor it does not own."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file

from parallel.layout import ParallelLayout
from parallel.world import spawn
from sync.delta import header
from tests.sync.conftest import tiny_qwen3_moe_config
from tests.sync.test_sync_broadcast import assert_same
from tests.sync.test_sync_stages import rank_setup

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")
ANCHORS = [True, False, False, False, True]  # full_every 4: versions 1 and 5 are anchors
INVALIDATED = 4  # before this version the owners of EP rank 1 (TP only: TP rank 1) forget their kept version


def owner_sync(hf_dir: str, ports: list[int], out_dir: str, layout: ParallelLayout, fp8_blocks: int | None) -> dict:
    """Rank function: versions 1-5, each after a real change of ~5% of every parameter's elements;
    per version the dense export (the reference, and its EP gather bytes), then the update with
    owner-side diffs (what it yielded, its EP gather bytes, the coordinator's delta stats)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from safetensors.torch import save_file

    from parallel.export import export_hf_weights
    from parallel.fp8 import BlockFP8
    from parallel.gathers import GATHER_BYTES
    from sync.config import DeltaConfig, SyncConfig
    from sync.shapes import SyncSetup, make_syncer

    bridge, model, sources, clients = rank_setup(hf_dir, ports, layout)
    fp8 = None if fp8_blocks is None else BlockFP8(fp8_blocks, fp8_blocks)
    config = SyncConfig(bucket_bytes=16384, timeout_s=60, delta=DeltaConfig(enabled=True, full_every=4))
    syncer = make_syncer(clients, SyncSetup(config, sources))
    rank, ep_rank = dist.get_rank(), ps.get_expert_model_parallel_rank()
    invalidated = (ep_rank if layout.ep > 1 else ps.get_tensor_model_parallel_rank()) == 1
    versions = []
    for version in range(1, 6):
        torch.manual_seed(version)
        with torch.no_grad():
            for param in model.parameters():
                moved = torch.rand(param.shape) < 0.05
                param.add_(torch.where(moved, 0.002 * torch.randn(param.shape), 0.0).to(param.dtype))
        before = GATHER_BYTES["received"]
        reference = {name: t.clone() for name, t in export_hf_weights(model, bridge, 16384, fp8=fp8)}
        dense_gather = GATHER_BYTES["received"] - before
        if version == INVALIDATED and invalidated:
            syncer.owner.kept.invalidate()
        yielded = {}

        def recorded(items):
            for name, tensor in items:
                yielded[name] = tensor.clone()
                yield name, tensor

        before = GATHER_BYTES["received"]
        stats = syncer.update(recorded(export_hf_weights(model, bridge, 16384, fp8=fp8, owner=syncer.owner)), version)
        if stats is not None:
            for i, client in enumerate(clients):
                client.dump_weights(f"{out_dir}/engine{i}-v{version}.safetensors")
        files = {"reference": reference, "yielded": yielded}  # safetensors: FP8 does not pickle back
        for what, tensors in files.items():
            save_file(
                {n: t.contiguous() for n, t in tensors.items()}, f"{out_dir}/{what}-r{rank}-v{version}.safetensors"
            )
        versions.append(
            {
                "dense_gather": dense_gather,
                "gather": GATHER_BYTES["received"] - before,
                "stats": None if stats is None else stats.delta,
            }
        )
        dist.barrier()
    source = syncer.sender or getattr(syncer, "source", None)  # this stage's source, if this rank is one
    kept = sorted(source.kept.tensors) if source is not None else []
    owned = {name: reference_bytes(t) for name, t in syncer.owner.kept.tensors.items()}
    syncer.close()
    return {
        "rank": rank,
        "source": rank in sources.values(),
        "coordinator": syncer.sender is not None,
        "ep_rank": ep_rank,
        "stage": ps.get_pipeline_model_parallel_rank(),
        "invalidated": invalidated,
        "tp_group": dist.get_process_group_ranks(ps.get_tensor_model_parallel_group()),
        "local_experts": tiny_qwen3_moe_config().num_experts // ps.get_expert_model_parallel_world_size(),
        "versions": versions,
        "source_kept": kept,
        "owner_kept": owned,
    }


def reference_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize(
    "layout, fp8_blocks",
    [
        (ParallelLayout(world_size=2, ep=2), None),
        (ParallelLayout(world_size=2, ep=2), 16),
        (ParallelLayout(world_size=4, pp=2, ep=2), None),
        (ParallelLayout(world_size=2, tp=2, sequence_parallel=True), 16),
        (ParallelLayout(world_size=4, tp=2, ep=2, sequence_parallel=True), None),
    ],
    ids=["ep2-bf16", "ep2-fp8", "pp2-ep2-bf16", "tp2-fp8", "tp2-ep2-bf16"],
)
def test_expert_owners_send_payloads_over_the_ep_gather(engines, tmp_path, layout, fp8_blocks):
    from transformers import Qwen3MoeForCausalLM

    clients, _ = engines
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(tiny_qwen3_moe_config()).save_pretrained(tmp_path / "hf")
    ports = [int(c.url.rsplit(":", 1)[1]) for c in clients]
    ranks = spawn(owner_sync, layout.world_size, str(tmp_path / "hf"), ports, str(tmp_path), layout, fp8_blocks)
    sources = [r for r in ranks if r["source"]]
    (coordinator,) = [r for r in ranks if r["coordinator"]]
    for r in sources:
        for v, step in enumerate(r["versions"], start=1):
            for what in ("reference", "yielded"):
                step[what] = load_file(tmp_path / f"{what}-r{r['rank']}-v{v}.safetensors")
    invalid = {n for r in ranks if r["invalidated"] for n in r["owner_kept"]}  # what those owners keep
    for v, anchor in enumerate(ANCHORS):
        version = v + 1
        want = {name: t for r in sources for name, t in r["versions"][v]["reference"].items()}
        for i in range(len(clients)):  # bit-equal to a full sync of the same weights
            assert_same(load_file(tmp_path / f"engine{i}-v{version}.safetensors"), want)
        stats = coordinator["versions"][v]["stats"]
        assert stats.anchor == anchor
        own = coordinator["versions"][v]["reference"]  # the coordinator's stage: what its stats count
        assert stats.dense_bytes == sum(t.numel() * t.element_size() for t in own.values())
        for r in sources:
            step = r["versions"][v]
            experts = {name: t for name, t in step["yielded"].items() if EXPERT.search(name)}
            assert experts and step["dense_gather"] > 0
            if anchor:  # the gathers carry the dense bytes (TP: handed over by the diff owners), as they are
                assert layout.tp > 1 or step["gather"] == step["dense_gather"]
                assert all(torch.equal(t, step["reference"][name]) for name, t in experts.items())
                continue
            every = {name: header(t) for name, t in step["yielded"].items()}  # every tensor: a payload
            assert all((h.base_version, h.version) == (version - 1, version) for h in every.values())
            # an owner with no kept version sends dense payloads, dense tensors' owners too; the others diff
            went_dense = {n for n, h in every.items() if h.encoding == "dense"}
            assert went_dense == (invalid & set(every) if version == INVALIDATED else set()), sorted(went_dense)[:3]
            if layout.tp > 1:  # the other TP members' share reaches the source as payloads (EP bytes: TP1 below)
                assert version == INVALIDATED or step["gather"] < step["dense_gather"], step
                continue
            others = [n for n in experts if int(EXPERT.search(n)[1]) >= r["local_experts"]]
            crossed = sum(experts[n].numel() for n in others)  # the other owners' payloads
            # the EP gather of a full sync: the other owners' dense experts (16-byte aligned); the
            # TP/ETP gathers (dense either way) carry the rest of `dense_gather`
            ep_dense = sum(-(-reference_bytes(step["reference"][n]) // 16) * 16 for n in others)
            ep_moved = step["gather"] - (step["dense_gather"] - ep_dense)
            assert layout.tp > 1 or ep_dense == step["dense_gather"]
            # the invalidated owner's: dense + per tensor a header, its length and alignment (< 128 B)
            bound = ep_dense + 128 * len(others) if version == INVALIDATED else ep_dense / 2
            assert crossed <= ep_moved < bound, (version, crossed, ep_moved, ep_dense)
        if not anchor:  # changed elements, counted from the owners' headers
            before = coordinator["versions"][v - 1]["reference"]
            changed = 0
            for name, t in own.items():
                gone = version == INVALIDATED and name in invalid
                changed += t.numel() if gone else int((_bits(t) != _bits(before[name])).sum())
            assert stats.changed == changed
            assert stats.wire_bytes < 0.5 * stats.dense_bytes or version == INVALIDATED
    for r in sources:  # every tensor is owned: the source keeps none of another's
        assert r["source_kept"] == []
    owners = [r for r in ranks if any(EXPERT.search(n) for n in r["owner_kept"])]  # ETP-rank-0 of each EP rank
    assert sorted(r["ep_rank"] for r in owners) == sorted(list(range(layout.ep)) * layout.pp)
    for r in owners:
        local = {int(EXPERT.search(n)[1]) // r["local_experts"] for n in r["owner_kept"] if EXPERT.search(n)}
        assert local == {r["ep_rank"]}, (r["rank"], sorted(local))
    for stage in range(layout.pp):  # the TP members of the source replica share the dense tensors
        (source,) = [r for r in sources if r["stage"] == stage]
        dense = {n: t for n, t in source["versions"][-1]["reference"].items() if not EXPERT.search(n)}
        shares = [
            {n: b for n, b in r["owner_kept"].items() if not EXPERT.search(n)}
            for r in ranks
            if r["rank"] in source["tp_group"]
        ]
        assert sorted(n for share in shares for n in share) == sorted(dense)  # each kept once, by one
        total = sum(reference_bytes(t) for t in dense.values())
        kept = [sum(share.values()) for share in shares]  # balanced by bytes: about 1/tp each
        assert len(kept) == layout.tp and all(total / (2 * layout.tp) <= k <= 1.5 * total / layout.tp for k in kept), (
            kept,
            total,
        )
