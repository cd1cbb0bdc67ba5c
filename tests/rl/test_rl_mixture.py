"""A two-task mixture in the RL loop (Ray on CPU: Megatron ranks EP2 over gloo, a real embedded
engine, real weight syncs): per-task metrics equal to the dumped samples of each task, an eval
dataset named like an entry, and an exact resume: every trained group, before and after
`--resume`, is the prompt an uninterrupted run draws for its group id."""

from __future__ import annotations

import itertools
import json
import os

import pytest

from moe_rl.config import RunConfig, from_dict
from moe_rl.rollout.dump import EVAL_DIR, ROLLOUTS_DIR, SampleDump
from tests.tiny_models import QWEN3_MOE_SMALL, hf_fields

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
TASKS = [
    {"name": "copy", "task": "copy_digits", "weight": 3, "task_options": {"length": 2}},
    {"name": "rev", "task": "reverse_digits", "weight": 1, "task_options": {"length": 2}},
]


def config(tmp_path, steps: int, tasks: list[dict] = TASKS) -> RunConfig:
    rollout = {"tasks": tasks, "groups_per_step": 4, "n_samples_per_prompt": 2, "max_new_tokens": 2, "dump": True}
    rollout["max_staleness"] = 0  # sync mode's
    return from_dict(
        RunConfig,
        {
            "model": {"hf_config": hf_fields(QWEN3_MOE_SMALL, max_position_embeddings=64)},
            "trainer": {"world_size": 2, "ep": 2, "micro_batch_size": 4, "global_batch_size": 8},
            "rollout": rollout,
            "eval": {"datasets": [{"name": "rev", "task": "reverse_digits", "num_prompts": 2}], "at_end": True},
            "rl": {"mode": "sync", "report": False, "save_hf": False, "checkpoint_every": 2},
            "steps": steps,
            "save_checkpoint": False,
            "output_dir": str(tmp_path / "run"),
        },
    )


def test_a_two_task_mixture_logs_per_task_and_resumes_exactly(tmp_path):
    from moe_rl.jobs import rl

    first = config(tmp_path, steps=2)
    rl.run(first)
    run_dir = tmp_path / "run"
    dumps = SampleDump(run_dir / ROLLOUTS_DIR)
    before = {step: dumps.read(step) for step in (1, 2)}
    rl.run(config(tmp_path, steps=3), resume=True)  # from the step-2 checkpoint
    after = {step: dumps.read(step) for step in (1, 2, 3)}
    assert after[1] == before[1] and after[2] == before[2]  # the steps before the checkpoint are kept

    # every trained group is the draw an uninterrupted run makes for its id (g<seed>-<k>: the k-th)
    draws = list(itertools.islice(first.rollout.make_task().prompts(first.rollout.seed), 64))
    records = [r for step in (1, 2, 3) for r in after[step]]
    for record in records:
        k = int(record["group_id"].split("-")[1])
        assert (record["task"], record["prompt_ids"]) == (draws[k].task, draws[k].prompt_ids), record["group_id"]
    trained = [json.loads(line)["groups"] for line in (run_dir / "trained.jsonl").read_text().splitlines()]
    # sync mode: step 3 trains draws 8-11 (in completion order), as an uninterrupted run does
    assert sorted(int(gid.split("-")[1]) for gid in trained[2]) == [8, 9, 10, 11]

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "rollout/reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for row in steps:  # per-task metrics are the dumped samples of each task
        samples = after[row["step"]]
        for name in ("copy", "rev"):
            rewards = [r["reward"] for r in samples if r["task"] == name]
            key = f"rollout/task/{name}/reward_mean"
            assert (key in row) == bool(rewards), (row["step"], name)
            if rewards:
                assert row[key] == pytest.approx(sum(rewards) / len(rewards), abs=1e-12)
                assert row[f"rollout/task/{name}/samples"] == len(rewards)
    last = steps[-1]
    started = int(last["rollout/groups_started"])  # drawn per task, counted on through the resume
    drawn = {name: last.get(f"rollout/task/{name}/prompts_drawn", 0) for name in ("copy", "rev")}
    assert drawn == {name: sum(p.task == name for p in draws[:started]) for name in ("copy", "rev")}
    assert last["rollout/task/copy/reward_errors"] == last["rollout/task/rev/reward_errors"] == 0

    evals = [r for r in rows if "eval/rev/reward_mean" in r]
    assert evals and all(r["task"] == "rev" for r in SampleDump(run_dir / EVAL_DIR / "rev").read(evals[-1]["step"]))

    swapped = [{**TASKS[0], "weight": 1}, {**TASKS[1], "weight": 3}]
    with pytest.raises(ValueError, match=r"written with the mixture \[\['copy', 3.0\], \['rev', 1.0\]\]"):
        rl.run(config(tmp_path, steps=4, tasks=swapped), resume=True)
