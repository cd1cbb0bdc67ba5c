"""`moe-rl plan` with `sync.delta`: wire bytes from the codec's arithmetic, anchors amortised; as
built (expert owners diff before the EP gather, the TP members their share of the rest after the
dense TP gather) and owner-side (TP shards diffed before the TP gather: not built): the encode and
kept copies of each; bytes per engine rank, a cross-datacentre link, the 1T config."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

from moe_rl import cli
from moe_rl.config import load_config
from moe_rl.plan.delta import HEADER_BYTES, HOST_PASSES, PCIE_GB_PER_S, SOURCE_PCIE_PASSES, encoded_fraction
from moe_rl.plan.planner import make_plan
from moe_rl.plan.sync_links import NIC_EFFICIENCY

ABSENT = Path("absent.json")  # no GPU measurements: modelled efficiencies only
DELTA = ("sync.delta.enabled=true",)
BUSIEST = "delta encode, PCIe of the busiest sending rank"


@cache
def plan(stem: str, *overrides: str, link_gbps: float | None = None):
    return make_plan(
        load_config(f"configs/models/{stem}.yaml", list(overrides)), gpu_metrics=ABSENT, link_gbps=link_gbps
    )


def test_encoded_fraction_is_the_smallest_encoding():
    assert encoded_fraction(2, 0.01) == pytest.approx(0.02)  # gaps: 0.01 x (2 + 2) of 2 bytes
    assert encoded_fraction(1, 0.01) == pytest.approx(0.03)  # FP8: 0.01 x (2 + 1) of 1 byte
    assert encoded_fraction(2, 0.1) == pytest.approx((1 / 8 + 0.2) / 2)  # the bitmap wins above 1/16
    assert encoded_fraction(2, 0.95) == 1.0  # dense above 1 - 1/(8 x 2)
    assert encoded_fraction(2, 0.01, "bitmap") == pytest.approx((1 / 8 + 0.02) / 2)


def test_delta_wire_bytes_equal_the_formula_bf16():
    p = plan("qwen3_30b_a3b", *DELTA)
    c = p.params
    assert p.delta.bytes == pytest.approx(c.total * 2 * 0.02 + HEADER_BYTES * c.tensors)


def test_delta_wire_bytes_equal_the_formula_fp8():
    """Decoder layers: FP8 deltas (3% of a byte a parameter) and dense float32 scales per 128 x 128;
    embedding and head: bf16 deltas; a header per tensor, FP8's scale tensors included."""
    p = plan("deepseek_v3", *DELTA, "sync.fp8_blocks=128")
    c = p.params
    layers = sum(c.dense_per_layer) + c.experts
    headers = HEADER_BYTES * (2 * c.layer_tensors + c.tensors - c.layer_tensors)
    expected = layers * (0.03 + 4 / 128**2) + (c.embedding + c.head) * 2 * 0.02 + headers
    assert p.delta.bytes == pytest.approx(expected)


def test_anchors_are_amortised_and_full_every_one_is_an_anchor():
    """Owner-side, an anchor is the full sync; as built, the full sync with each sending rank's kept
    copy following over its PCIe (one pass of what it diffs)."""
    p = plan("deepseek_v3", *DELTA, "sync.fp8_blocks=128")
    built, owner = p.delta, p.delta.owner_side
    assert owner.full_seconds == p.sync_seconds
    busiest = built.links.per_link()[BUSIEST][0] / SOURCE_PCIE_PASSES  # one stage: one turn
    assert built.full_seconds == pytest.approx(max(p.sync_seconds, busiest / (PCIE_GB_PER_S * 1e9)))
    for d in (built, owner):
        assert d.per_step == pytest.approx((49 * d.seconds + d.full_seconds) / 50)
    every = plan("deepseek_v3", *DELTA, "sync.fp8_blocks=128", "sync.delta.full_every=1").delta
    assert every.per_step == pytest.approx(built.full_seconds)
    assert every.owner_side.per_step == pytest.approx(p.sync_seconds)


def test_owner_side_owners_encode_their_shards_and_keep_them_in_host_memory():
    """Owner-side (TP shards before the TP gather: not built), Qwen3-30B-A3B (TP1, EP8): the root
    diffs the dense weights and its 1/8 of the experts over PCIe; the kept copies add up to one full
    sync, all on node 0 (the EP group's node)."""
    p = plan("qwen3_30b_a3b", *DELTA)
    c, owner = p.params, p.delta.owner_side
    nbytes, seconds = owner.encode()
    assert nbytes == pytest.approx(2 * (c.total - c.experts + c.experts / 8))
    assert seconds == pytest.approx(nbytes / (PCIE_GB_PER_S * 1e9))
    assert sum(owner.kept.values()) == pytest.approx(p.sync_bytes) and set(owner.kept) == {0}
    kimi = plan("kimi_k2", *DELTA).delta.owner_side
    assert sum(kimi.kept.values()) == pytest.approx(plan("kimi_k2", *DELTA).sync_bytes)


def _turn_bytes(links, prefix: str) -> list[dict[str, float]]:
    return [{link.name: link.bytes for link in turn if link.name.startswith(prefix)} for turn in links.turns]


@pytest.mark.parametrize(
    "stem, overrides",
    [
        ("qwen3_30b_a3b", ()),  # one turn, TP2 EP8 on one node
        ("qwen3_235b_a22b", ()),  # PP2: two stage turns
        ("deepseek_v3", ("sync.fp8_blocks=128",)),  # FP8, EP members on other nodes: gather NICs
        ("glm45", ()),  # PP4
        ("qwen3_235b_a22b", ("sync.stage_groups=false",)),  # the funnel: every stage through stage 0
    ],
)
def test_as_built_the_ep_gather_is_encoded_and_the_broadcast_too(stem, overrides):
    """As built, expert owners diff before the EP gather and the TP members their share of the rest
    after the TP gather: the gathers carry fewer bytes than the full sync's (the experts encoded,
    the other members' dense shares as payloads) but no fewer than owner-side (the root's own share
    dense), the broadcast carries the deltas; the funnel diffs at its root, so its gathers and
    funnel carry exactly the full sync's bytes."""
    p = plan(stem, *DELTA, *overrides)
    built, full = p.delta.links, p.sync_links
    owner = p.delta.owner_side.links
    if "sync.stage_groups=false" in overrides:
        assert _turn_bytes(built, "gather") == _turn_bytes(full, "gather")
        assert _turn_bytes(built, "funnel") == _turn_bytes(full, "funnel")
    else:
        into_root = "gather, NVLink into the root"
        for b, f, o in zip(*(_turn_bytes(links, "gather") for links in (built, full, owner))):
            assert o[into_root] <= b[into_root] < f[into_root], (o, b, f)
            assert all(o[name] <= b[name] <= f[name] for name in b)
    broadcast = built.per_link()
    assert broadcast["broadcast, each NIC of the root's node"][0] * built.nics == pytest.approx(p.delta.bytes)
    if built.nics > 1:
        assert broadcast["broadcast, NVLink root to relays"][0] == pytest.approx(p.delta.bytes)


def test_as_built_each_sending_rank_encodes_and_keeps_what_it_diffs():
    """Qwen3-30B-A3B (TP1, EP8, one node): the source diffs the non-expert weights and its 1/8 of the
    experts over its PCIe, each other owner its own experts; the kept copies add up to one full sync,
    on node 0, whose host memory moves them HOST_PASSES times. Qwen3-235B-A22B (PP2): the kept copies
    are one full sync over both stages' nodes. The funnel's root encodes and keeps everything."""
    p = plan("qwen3_30b_a3b", *DELTA)
    c = p.params
    nbytes, seconds = p.delta.links.per_link()[BUSIEST]
    assert nbytes == pytest.approx(SOURCE_PCIE_PASSES * 2 * (c.total - c.experts + c.experts / 8))
    assert seconds == pytest.approx(nbytes / (PCIE_GB_PER_S * 1e9))
    assert p.delta.kept == pytest.approx({0: p.sync_bytes})
    host = p.delta.links.per_link()["delta encode, host memory of busiest node"][0]
    assert host == pytest.approx(HOST_PASSES * p.sync_bytes)
    q = plan("qwen3_235b_a22b", *DELTA)
    assert sum(q.delta.kept.values()) == pytest.approx(q.sync_bytes) and len(q.delta.kept) > 2
    funnel = plan("qwen3_235b_a22b", *DELTA, "sync.stage_groups=false")
    assert funnel.delta.kept == pytest.approx({0: funnel.sync_bytes})
    assert funnel.delta.links.per_link()[BUSIEST][0] == pytest.approx(SOURCE_PCIE_PASSES * funnel.sync_bytes)


@pytest.mark.parametrize("stem", ["deepseek_v3", "kimi_k2", "qwen3_235b_a22b"])
def test_as_built_the_tp_members_diff_their_share_of_the_dense_tensors(stem):
    """TP8 / TP4 trainers: as built, every TP member of the source replica diffs 1/tp of its stage's
    non-expert bytes (the root besides its own experts), the owners of the owner-side design: the
    busiest sending rank copies what that design's busiest owner does and the kept copies lie on
    the same nodes; into the root the TP gather carries its own 1/tp dense and the others'
    payloads. The busiest sending rank's PCIe (its kept copy up to the GPU compare) bounds the step."""
    p = plan(stem, *DELTA, "sync.fp8_blocks=128")
    built, owner = p.delta, p.delta.owner_side
    busiest = owner.links.per_link()["delta encode, PCIe of the busiest owner"][0]
    assert built.links.per_link()[BUSIEST][0] == pytest.approx(SOURCE_PCIE_PASSES * busiest)
    assert built.kept == pytest.approx(owner.kept)
    into_root = "gather, NVLink into the root"
    tp = load_config(f"configs/models/{stem}.yaml").trainer.tp
    for b, o, f in zip(*(_turn_bytes(links, "gather") for links in (built.links, owner.links, p.sync_links))):
        # over owner-side's payloads: the other members' shards of the root's own 1/tp, dense
        assert o[into_root] < b[into_root] <= o[into_root] + f[into_root] / tp, (b, o, f)
    assert built.links.bottleneck.name == BUSIEST


def test_an_engine_rank_receives_tp_times_its_shard():
    """SGLang's broadcast gives every TP rank each whole bucket: without DP attention an engine
    rank receives engines.tp times its own shard; DP attention (dense replicated) a little less."""
    for stem in ("glm45_air", "qwen3_30b_a3b", "glm45"):
        p = plan(stem)
        own, ratio = p.engine_rank
        tp = load_config(f"configs/models/{stem}.yaml").engines.tp
        assert ratio == pytest.approx(tp) and own == pytest.approx(p.sync_bytes / tp)
    assert 8 < plan("kimi_k2").engine_rank[1] < 16  # TP16 with DP attention over 8 groups


def test_shipped_1t_and_355b_configs_plan(capsys):
    for stem in ("kimi_k2", "glm45"):
        assert cli.main(["plan", f"configs/models/{stem}.yaml", *DELTA]) == 0
    out = capsys.readouterr().out
    assert "sync delta (as built; sync.delta, at density 0.01" in out and "host memory per node (GB, pinned" in out
    assert "owner-side diffs (TP shards before the TP gather: not built): ~" in out
    assert "Perplexity Kimi-K2 1.3 s" in out and "slime GLM-4.5-355B 48 s" in out
    assert plan("kimi_k2").params.total == pytest.approx(1.026e12, rel=0.01)
    assert plan("glm45").params.total == pytest.approx(352.8e9, rel=0.01)


DELTA_TARGETS = {  # issue 44: seconds a step at 1%, anchors amortised (modelled)
    ("deepseek_v3", "sync.fp8_blocks=128"): 0.5,
    ("qwen3_235b_a22b", "sync.fp8_blocks=128"): 0.5,
    ("kimi_k2", "sync.fp8_blocks=128"): 1.3,
}


@pytest.mark.parametrize("stem, fp8", sorted(DELTA_TARGETS))
def test_as_built_meets_the_delta_targets_bound_by_pcie(stem, fp8):
    """As built (experts diffed by their owners, dense tensors by the TP members, on their GPUs)
    meets issue 44's targets, as the owner-side design does: the busiest sending rank's PCIe bounds
    it (its kept copy up once), no longer the stage source node's host memory, which reads the kept
    copies once. A host compare (the new bytes down, then read with the kept copy: three passes)
    would miss DeepSeek-V3's and Qwen3-235B-A22B's."""
    p = plan(stem, *DELTA, fp8)
    target = DELTA_TARGETS[stem, fp8]
    assert p.delta.per_step <= target and p.delta.owner_side.per_step <= target, p.render()
    assert p.delta.links.bottleneck.name == BUSIEST
    host = p.delta.links.per_link()["delta encode, host memory of busiest node"]
    if stem != "kimi_k2":
        assert 3 * host[1] > target, "three host passes would have met the target too"


def test_qwen3_235b_in_bf16_owner_side_is_bound_by_the_encode():
    """Owner-side, the bf16 sync misses 0.5 s: two stage turns, each root diffing ~16 GB over PCIe."""
    owner = plan("qwen3_235b_a22b", *DELTA).delta.owner_side
    assert owner.per_step > 0.5 and owner.links.bottleneck.name == "delta encode, PCIe of the busiest owner"


def test_a_cross_datacentre_link_carries_every_byte_once(capsys):
    p = plan("kimi_k2", *DELTA, link_gbps=10)
    rate = 10 / 8 * NIC_EFFICIENCY * 1e9
    assert p.sync_seconds == pytest.approx(p.sync_bytes / rate)
    assert p.delta.links.per_link()["cross-datacentre link"][0] == pytest.approx(p.delta.bytes)
    assert p.delta.owner_side.seconds == pytest.approx(p.delta.bytes / rate)
    assert p.delta.owner_side.per_step < 60  # seconds, not minutes
    assert cli.main(["plan", "configs/models/kimi_k2.yaml", "--link-gbps", "10"]) == 0
    assert "cross-datacentre link" in capsys.readouterr().out
    assert cli.main(["plan", "configs/models/kimi_k2.yaml", "--link-gbps", "0"]) == 2
    assert "--link-gbps 0: must be > 0" in capsys.readouterr().err


def test_a_measured_encode_rate_replaces_pcie(tmp_path):
    """Where the GPU check measured the encode's rate per rank (`tests/gpu/test_delta_cuda.py`), the
    owner-side encode runs at it (never faster than PCIe), and the as-built busiest sending rank's
    GPU compare takes what it diffs at it."""
    import json

    metrics = tmp_path / "gpu_metrics.json"
    rate = {"value": 2.0, "unit": "GB/s of shard per rank", "gpu": "NVIDIA H200", "date": "2026-12-06"}
    metrics.write_text(json.dumps({"measured": {"delta_encode_gb_per_s": rate}}))
    config = load_config("configs/models/qwen3_30b_a3b.yaml", list(DELTA))
    p = make_plan(config, gpu_metrics=metrics)
    nbytes, seconds = p.delta.owner_side.encode()
    assert seconds == pytest.approx(nbytes / 2e9)
    compare = p.delta.links.per_link()["delta encode, GPU compare (measured)"]
    busiest = p.delta.links.per_link()[BUSIEST][0] / SOURCE_PCIE_PASSES
    assert compare == pytest.approx((busiest, busiest / 2e9))
    assert p.delta.encode() == compare  # slower than PCIe at 50 GB/s
    assert "GPU compare measured on NVIDIA H200, 2026-12-06" in p.render()
