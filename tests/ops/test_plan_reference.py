"""`moe-rl plan` counts the frozen KL reference: one more copy of the stage's weights per GPU."""

from __future__ import annotations

from pathlib import Path

from moe_rl.config import load_config
from moe_rl.plan import make_plan


def test_reference_adds_one_weight_copy():
    path = sorted(Path("configs/models").glob("qwen3_30b_a3b.yaml"))[0]
    without = make_plan(load_config(path)).trainer_memory
    with_kl = make_plan(load_config(path, ["algorithm.kl_coef=0.01"])).trainer_memory
    assert "reference" not in without
    assert with_kl["reference"] == without["weights"]
    assert abs(with_kl["total"] - without["total"] - without["weights"]) < 1e-9
