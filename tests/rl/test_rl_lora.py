"""An RL run with LoRA end to end (Ray, Megatron EP2 ranks, a real embedded engine): adapters
only move (no pause), every group is trained once or dropped with a reason, the engine ends with
at most max_staleness + 1 adapters, and the final adapter, loaded by PEFT on the base, gives the
logprobs of the merged `final_hf/` checkpoint. Then the run is resumed from its adapter-only run
checkpoint for more steps: metrics continue, adapter versions continue."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from moe_rl.config import RunConfig, from_dict
from tests.rl.test_rl_modes import PROBE_BOUND
from tests.tiny_models import QWEN3_MOE_SMALL, hf_fields

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
STEPS = 4


# Two runs (the first, then its resume), each starting Ray, two trainer ranks and an engine: under a
# busy loop per core this took over 600 s (pytest's default limit), so the limit is the hang guard.
@pytest.mark.timeout(1800)
def test_rl_with_lora(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from moe_rl.jobs import rl

    config = from_dict(
        RunConfig,
        {
            "model": {"hf_config": hf_fields(QWEN3_MOE_SMALL, max_position_embeddings=64)},
            "lora": {"rank": 2, "alpha": 4},
            "trainer": {
                "world_size": 2,
                "ep": 2,
                "micro_batch_size": 4,
                "global_batch_size": 8,
                "routing_replay": True,
                "optimizer": {"lr": 0.05},
                "consistency_probe_every": 3,
            },
            "rollout": {
                "task": "copy_digits_long_tail",
                "task_options": {"num_stop_tokens": 40, "length": 6},
                # a group whose samples tie has zero GRPO advantage: regenerate it, so every
                # step trains on a signal whatever the random rewards
                "drop_zero_variance_groups": True,
                "groups_per_step": 4,
                "n_samples_per_prompt": 2,
                "max_new_tokens": 12,
                "max_staleness": 1,
            },
            "sync": {"lora_route": "disk"},
            "rl": {"mode": "fully_async", "report": False, "checkpoint_every": 2},
            "steps": STEPS,
            "output_dir": str(tmp_path / "run"),
        },
    )
    summary = rl.run(config)
    ledger, trained = summary["ledger"], summary["trained_group_ids"]
    assert len(trained) == len(set(trained)) == STEPS * 4 and set(trained) == set(ledger["delivered"])
    assert set(ledger["started"]) == set(ledger["delivered"]) | set(ledger["dropped"])
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["rollout/continued_requests"] == 0 for r in rows)  # never paused, never cut
    assert all(r["buffer/staleness_max"] <= 1 for r in rows)
    assert all(r["train/grad_norm"] > 0 for r in rows)
    # the probe scores under the adapter of its version: the fp32 arithmetic's gap, where the base
    # model alone would be as far off as the adapter moved it (> 1e-3 below)
    (probed,) = [r for r in rows if "consistency/probe/skipped" in r]
    assert probed["step"] == 3 and probed["consistency/probe/skipped"] == 0
    assert probed["consistency/probe/logprob_diff_max"] < PROBE_BOUND
    left = sorted(p.name for p in (tmp_path / "run" / "adapters").iterdir())
    assert f"policy-v{STEPS}" in left and len(left) <= 3

    tokens = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(0))
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "initial_hf", dtype=torch.float32)
    with torch.no_grad():
        before = base.eval()(tokens).logits
        adapted = PeftModel.from_pretrained(base, tmp_path / "run" / "final_adapter").eval()(tokens).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final_hf", dtype=torch.float32)(tokens).logits
    assert (adapted - merged).abs().max() < 1e-4
    assert (adapted - before).abs().max() > 1e-3  # the adapter learned something

    more = dataclasses.replace(config, steps=STEPS + 2)
    rl.run(more, resume=True)
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 3))
    left = sorted(p.name for p in (tmp_path / "run" / "adapters").iterdir())
    assert f"policy-v{STEPS + 2}" in left
