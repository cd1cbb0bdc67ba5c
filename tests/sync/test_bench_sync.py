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
