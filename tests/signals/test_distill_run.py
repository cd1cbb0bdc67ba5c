"""On-policy distillation end to end (issue 45's done-when): a fresh student trained only by the
per-token reverse KL to a served teacher (`algorithm.distill.mode: pure`) reaches the teacher's
reward on `copy_digits`, and `distill/reverse_kl` falls. Real Ray job: a Megatron trainer rank, an
embedded engine for the student, one the run starts for the teacher (`tests/signals/distill_helpers.py`
fits it in seconds). The task's reward is logged, never trained on."""

from __future__ import annotations

import json
import os

import pytest
import torch

from moe_rl.config import RunConfig, from_dict
from moe_rl.jobs import preflight
from moe_rl.tasks.digits import BOS, DIGIT0, SEP
from tests.signals.distill_helpers import TEACHER_MODEL, copy_teacher

pytestmark = pytest.mark.world  # Ray, a trainer rank and two engines (tests/conftest.py)

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
STEPS = 480
LAST = 40
"""Steps whose rewards are averaged at the end (64 samples each)."""


def teacher_reward(path) -> float:
    """The teacher's expected copy_digits reward at temperature 1: its probability of a right
    token (one that reads as the prompt's digit), averaged over the ten prompts."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        probs = model(input_ids=torch.tensor([[BOS, DIGIT0 + d, SEP] for d in range(10)])).logits[:, -1].softmax(-1)
    return sum(float(probs[d, d::10].sum()) for d in range(10)) / 10


def test_a_student_trained_only_by_reverse_kl_reaches_the_teachers_reward(tmp_path):
    teacher = copy_teacher(tmp_path / "teacher")
    target = teacher_reward(teacher)
    config = from_dict(
        RunConfig,
        {
            "model": {"hf_config": TEACHER_MODEL},
            "trainer": {
                "world_size": 1,
                "micro_batch_size": 64,
                "global_batch_size": 64,
                "seed": 7,  # the student: a fresh random init, not the teacher's
                "optimizer": {"lr": 0.003},
            },
            "rollout": {
                "task": "copy_digits",
                "groups_per_step": 16,
                "n_samples_per_prompt": 4,
                "max_new_tokens": 1,
            },
            "algorithm": {"distill": {"teacher": {"path": str(teacher)}, "mode": "pure"}},
            "sync": {"bucket_bytes": 1 << 20},
            "rl": {"mode": "fully_async", "report": False, "save_hf": False},
            "steps": STEPS,
            "output_dir": str(tmp_path / "run"),
        },
    )
    preflight.check_run(config)
    from moe_rl.jobs import rl

    rl.run(config)
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert len(rows) == STEPS and all(row["time/teacher_s"] > 0 for row in rows)
    first, last = rows[:LAST], rows[-LAST:]

    def mean(window, key):
        return sum(row[key] for row in window) / len(window)

    assert mean(first, "rollout/reward_mean") < 0.2  # a random student: about a tenth of tokens are right
    assert mean(last, "rollout/reward_mean") > target - 0.05, (mean(last, "rollout/reward_mean"), target)
    assert mean(last, "distill/reverse_kl") < mean(first, "distill/reverse_kl") / 4
