"""On-policy distillation without a process: the config section and its refusals, the vocabulary
check before start, and the per-token advantages the batch builder writes (exact values)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from moe_rl.algorithms import AlgorithmConfig
from moe_rl.algorithms.config import DistillConfig, ServedConfig
from moe_rl.config import RunConfig, from_dict
from moe_rl.jobs import preflight
from moe_rl.rollout.train_batch import build_batch
from moe_rl.sample import Sample
from moe_rl.signals.teacher import check_vocabulary
from tests.signals.distill_helpers import TEACHER_MODEL

TINY_CHAT = Path(__file__).resolve().parents[2] / "configs" / "tokenizers" / "tiny_chat"


def model_dir(path: Path, **overrides) -> Path:
    """A config.json-only HF directory (the checks read no weights)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**TEACHER_MODEL, **overrides}))
    return path


def run_config(tmp_path, distill: dict, **rollout) -> RunConfig:
    return from_dict(
        RunConfig,
        {
            "model": {"hf_config": TEACHER_MODEL},
            "trainer": {"world_size": 1, "micro_batch_size": 8, "global_batch_size": 8},
            "rollout": {"task": "copy_digits", "groups_per_step": 2, "n_samples_per_prompt": 4, **rollout},
            "algorithm": {"distill": distill},
            "output_dir": str(tmp_path / "run"),
        },
    )


def test_distill_section_builds_and_refuses_with_the_field(tmp_path):
    teacher = model_dir(tmp_path / "teacher")
    config = from_dict(
        AlgorithmConfig,
        {"distill": {"teacher": {"path": str(teacher)}, "teachers": {"math": {"url": "http://h:1"}}, "mode": "add"}},
    )
    assert config.distill.served() == {None: ServedConfig(path=str(teacher)), "math": ServedConfig(url="http://h:1")}
    refusals = {
        "algorithm.distill.mode='both'": {"teacher": {"path": str(teacher)}, "mode": "both"},
        "algorithm.distill: set teacher": {},
        "algorithm.distill.teacher: give exactly one": {"teacher": {"path": str(teacher), "url": "http://h:1"}},
        "algorithm.distill.teachers.math.path='/nowhere': no config.json": {"teachers": {"math": {"path": "/nowhere"}}},
        "algorithm.distill.coef=0.0": {"teacher": {"url": "http://h:1"}, "coef": 0.0},
    }
    for message, section in refusals.items():
        with pytest.raises(ValueError, match=f"^{message}".replace("(", r"\(").replace(".", r"\.")):
            from_dict(AlgorithmConfig, {"distill": section})
    with pytest.raises(ValueError, match="drop_zero_variance_groups: false"):
        run_config(tmp_path, {"teacher": {"path": str(teacher)}}, drop_zero_variance_groups=True)


def test_preflight_refuses_a_teacher_of_another_vocabulary(tmp_path):
    config = run_config(tmp_path, {"teacher": {"path": str(model_dir(tmp_path / "wide", vocab_size=512))}})
    with pytest.raises(ValueError, match=r"^algorithm\.distill\.teacher\.path=.* has vocab_size 512, the student 256"):
        preflight.check_run(config)
    check_vocabulary(config.model, ServedConfig(path=str(model_dir(tmp_path / "same"))), "algorithm.distill.teacher")


def test_tokenizers_must_map_every_token_alike(tmp_path):
    student = from_dict(
        RunConfig, {**_fields(tmp_path), "model": {"hf_config": TEACHER_MODEL, "tokenizer": str(TINY_CHAT)}}
    )
    same = model_dir(tmp_path / "same")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_CHAT / name, same / name)
    check_vocabulary(student.model, ServedConfig(path=str(same)), "algorithm.distill.teacher")
    swapped = Path(shutil.copytree(same, tmp_path / "swapped"))
    tokenizer = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["!"], vocab[" "] = vocab[" "], vocab["!"]  # two ids exchanged
    (swapped / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match=r"maps 4 token/id pairs differently from the student's"):
        check_vocabulary(student.model, ServedConfig(path=str(swapped)), "algorithm.distill.teacher")


def _fields(tmp_path) -> dict:
    return {
        "trainer": {"world_size": 1, "micro_batch_size": 8, "global_batch_size": 8},
        "rollout": {"task": "copy_digits", "groups_per_step": 2, "n_samples_per_prompt": 4},
        "output_dir": str(tmp_path / "run"),
    }


def taught(reward: float, rollout: list[float], teacher: list[float], mask: list[int] | None = None) -> Sample:
    n = len(rollout)
    return Sample(
        prompt_ids=[1, 12, 2],
        response_ids=list(range(20, 20 + n)),
        rollout_logprobs=rollout,
        loss_mask=mask or [1] * n,
        weight_versions=[0] * n,
        reward=reward,
        teacher_logprobs=teacher,
        group_id="g",
        metadata={"teacher_s": 0.25},
    )


@pytest.mark.parametrize("mode", ["pure", "add"])
def test_token_advantages_are_the_reverse_kl(tmp_path, mode):
    """A_t = -coef (k_t - b_g) with k_t = S_t - T_t (pure), plus the group advantage (add)."""
    teacher = ServedConfig(path=str(model_dir(tmp_path / "t")))
    algorithm = AlgorithmConfig(advantage_estimator="dr_grpo", dr_grpo_norm_len=2)
    algorithm.distill = DistillConfig(teacher=teacher, coef=0.5, mode=mode)
    group = [taught(1.0, [-1.0, -2.0], [-0.5, -4.0]), taught(0.0, [-3.0, -1.0], [-1.0, -1.0], mask=[1, 0])]
    batch, info = build_batch([group], algorithm, version=0)
    reward_advantage = [0.5, -0.5] if mode == "add" else [0.0, 0.0]  # dr_grpo: r - mean
    # k_t = S_t - T_t: row 0 (-0.5, 2.0), row 1 (-2.0, 0.0; its second token is masked); the group's
    # baseline b is their mean over the 3 trained tokens; A_t = -coef (k_t - b) (+ the reward's)
    b = (-0.5 + 2.0 - 2.0) / 3
    expected = [[-0.5 * (-0.5 - b), -0.5 * (2.0 - b)], [-0.5 * (-2.0 - b), -0.5 * (0.0 - b)]]
    for row, (tokens, base) in enumerate(zip(expected, reward_advantage)):
        assert batch.advantages[row, 3:5].tolist() == pytest.approx([t + base for t in tokens], abs=1e-6)
    assert info.reverse_kl == pytest.approx(b)  # the raw mean k over the batch's trained tokens
    assert info.metrics()["distill/reverse_kl"] == info.reverse_kl and info.metrics()["time/teacher_s"] == 0.25
    assert info.advantages == pytest.approx(
        [sum(expected[0]) / 2 + reward_advantage[0], expected[1][0] + reward_advantage[1]]
    )
    plain = dataclasses.replace(algorithm, distill=None)
    batch, info = build_batch([group], plain, version=0)
    assert (
        torch.equal(batch.advantages[0, 3:5], torch.tensor([0.5, 0.5])) and "distill/reverse_kl" not in info.metrics()
    )
