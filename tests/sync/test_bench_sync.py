"""`moe-rl bench sync` end to end on a tiny model: the full sync (export, pack, checksums, broadcast,
stage, commit) and the raw broadcast move the same bytes; the source's extra memory stays within
2 buckets + the largest tensor. Structure only: timings are never asserted."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from moe_rl.cli import main
from tests.tiny_models import QWEN3_MOE, config_kwargs

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

MODEL = config_kwargs(QWEN3_MOE, vocab_size=1024, num_hidden_layers=2)


def test_bench_sync_reports_full_and_raw_of_the_same_bytes(tmp_path):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = tmp_path / "bench.yaml"
    config.write_text(
        yaml.safe_dump(
            dict(
                model=MODEL,
                layout=dict(world_size=2, ep=2),
                bucket_mb=1,
                export_bucket_mb=1,
                num_engines=1,
                repeats=1,
                output=str(tmp_path / "out.json"),
            )
        )
    )
    assert main(["bench", "sync", str(config)]) == 0
    result = json.loads((tmp_path / "out.json").read_text())
    model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**MODEL))
    assert result["bytes"] == sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert len(result["full_seconds"]) == len(result["raw_seconds"]) == 1
    assert 0 < result["ratio_best"] and result["peak_extra_within_bound"]
    stages = result["cpu_by_stage"]
    assert set(stages) == {"export", "pack", "hash", "broadcast", "receive", "full"}
    assert all(math.isfinite(row["cpu_s"]) for row in stages.values())
    assert all(math.isfinite(row["wall_s"]) for stage, row in stages.items() if stage != "receive")  # it overlaps
    # a sync costs CPU on the trainer ranks and on the receiver: the sums see both
    assert stages["full"]["cpu_s"] > 0 and stages["broadcast"]["cpu_s"] > 0


def _bench(tmp_path, name: str, **fields) -> dict:
    config = tmp_path / f"{name}.yaml"
    output = tmp_path / f"{name}.json"
    base = dict(model=MODEL, bucket_mb=1, export_bucket_mb=1, num_engines=2, repeats=1, output=str(output))
    config.write_text(yaml.safe_dump({**base, **fields}))
    assert main(["bench", "sync", str(config)]) == 0
    return json.loads(output.read_text())


def test_bench_sync_counts_bytes_per_link_and_stage_groups_divide_the_largest_sender(tmp_path):
    """PP2 (measured by the byte counters): with per-stage groups each stage's source sends its own
    stage's bytes, so the largest number of bytes any trainer rank sends is the larger stage's, not
    the whole model's (the funnel's root); every engine rank receives the model once either way."""
    staged = _bench(tmp_path, "staged", layout=dict(world_size=2, pp=2))
    funnel = _bench(tmp_path, "funnel", layout=dict(world_size=2, pp=2), stage_groups=False)
    assert staged["stage_groups"] and not funnel["stage_groups"]
    total = staged["bytes"]
    assert funnel["bytes"] == total
    for result in (staged, funnel):
        links = result["bytes_per_link"]
        assert [engine["broadcast"] for engine in links["engines"]] == [total, total]
        assert all(row["received"].get("broadcast", 0) == 0 for row in links["trainer"])
    s0, s1 = (row["sent"]["broadcast"] for row in staged["bytes_per_link"]["trainer"])
    assert s0 + s1 == total and min(s0, s1) > 0
    assert all(not row["received"] for row in staged["bytes_per_link"]["trainer"])  # nobody receives a stage's tensors
    root, second = funnel["bytes_per_link"]["trainer"]
    assert root["sent"] == {"broadcast": total} and root["received"] == {"funnel": s1}
    assert second["sent"] == {"funnel": s1}
    # the largest sender: the whole model through the funnel's root, one stage with stage groups;
    # the drop is PP x (mean stage / largest stage): 2 for equal stages
    largest_staged = staged["bytes_per_link"]["max_sent_by_a_trainer_rank"]
    largest_funnel = funnel["bytes_per_link"]["max_sent_by_a_trainer_rank"]
    assert largest_staged == max(s0, s1) and largest_funnel == total
    assert largest_funnel / largest_staged == 2 * (total / 2) / max(s0, s1)
