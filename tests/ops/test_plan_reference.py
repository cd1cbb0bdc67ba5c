"""`moe-rl plan` counts the frozen KL reference: one more copy of the stage's weights per GPU (none with LoRA)."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_rl.config import load_config
from moe_rl.plan.planner import make_plan


def test_reference_adds_one_weight_copy():
    path = sorted(Path("configs/models").glob("qwen3_30b_a3b.yaml"))[0]
    without = make_plan(load_config(path)).trainer_memory
    with_kl = make_plan(load_config(path, ["algorithm.kl_coef=0.01"])).trainer_memory
    assert "reference" not in without
    assert with_kl["reference"] == without["weights"]
    assert abs(with_kl["total"] - without["total"] - without["weights"]) < 1e-9


def test_lora_reference_costs_no_memory(tmp_path):
    """With LoRA the reference is the frozen base run with its adapters off: nothing to count,
    and a second model (ref_model_path) is refused."""
    path = "configs/models/qwen3_30b_a3b.yaml"
    lora = make_plan(load_config(path, ["lora.rank=16"])).trainer_memory
    lora_kl = make_plan(load_config(path, ["lora.rank=16", "algorithm.kl_coef=0.01"])).trainer_memory
    assert "reference" not in lora_kl and lora_kl == lora
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="ref_model_path=.* with lora: .*adapters off"):
        load_config(path, ["lora.rank=16", "algorithm.kl_coef=0.01", f"algorithm.ref_model_path={tmp_path}"])
