"""Served judges on real embedded engines: a generative judge (a tiny random model with the tiny
chat tokenizer, answering a fixed template greedily) scores what its parser reads; a run with
`rollout.reward: judge` logs rewards equal to the judge's parsed scores, predicted by making the
same call directly; a judge past its time limit and an answer without a score are counted and
scored `failed_score`, never fatal."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil

import pytest

from moe_rl.config import EngineConfig, RunConfig, from_dict
from moe_rl.engine.client import EngineClient
from moe_rl.engine.sampling import SamplingParams
from moe_rl.jobs import preflight
from moe_rl.signals.config import JudgeConfig
from moe_rl.signals.judge import Judge
from moe_rl.signals.served import ServedModel
from moe_rl.tasks.digits import CopyDigits
from tests.signals.distill_helpers import TEACHER_MODEL
from tests.signals.test_distill_config import TINY_CHAT
from tests.tiny_models import hf_config, save_random_model

pytestmark = pytest.mark.world  # engines, and a Ray run (tests/conftest.py)

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
TEMPLATE = "{prompt} -> {response} ({answer}). Score:"
PARSE = r"(\d)"
FAILED = -1.0


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    """A random tiny Qwen3-MoE over the tiny chat tokenizer's 128 ids, with its tokenizer files."""
    path = save_random_model(hf_config(TEACHER_MODEL, vocab_size=128), tmp_path_factory.mktemp("judge"), seed=3)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_CHAT / name, path / name)
    return path


def config(judge_dir, **overrides) -> JudgeConfig:
    return JudgeConfig(
        **{"path": str(judge_dir), "template": TEMPLATE, "parse": PARSE, "failed_score": FAILED, **overrides}
    )


async def direct(url: str, judge: Judge, prompt: str, response: str, answer: str) -> float:
    """The judge's call made by hand: the filled template, greedy generation, the first digit."""
    ids = judge.tokenizer(TEMPLATE.format(prompt=prompt, response=response, answer=answer), add_special_tokens=False)
    client = EngineClient(url)
    try:
        result = await client.generate(ids["input_ids"], SamplingParams(max_new_tokens=16, temperature=0.0))
    finally:
        await client.close()
    match = re.search(PARSE, judge.tokenizer.decode(result.output_ids, skip_special_tokens=True))
    return float(match.group(1)) if match else FAILED


def test_scores_timeouts_and_unparsable_answers_are_counted(judge_dir):
    served = ServedModel(config(judge_dir).served, EngineConfig())
    items = [(f"1{d}", f"{d}{d}", str(d)) for d in range(8)]
    try:

        async def run():
            judge = Judge(config(judge_dir), served.url())
            slow = Judge(config(judge_dir, timeout_s=1e-4), served.url())
            never = Judge(config(judge_dir, parse=r"no score here (\d)"), served.url())
            try:
                scores = await judge.score_group(items)
                expected = [await direct(served.url(), judge, *item) for item in items]
                return scores, expected, await slow.score_group(items), slow, await never.score_group(items), never
            finally:
                for j in (judge, slow, never):
                    await j.close()

        scores, expected, slow_scores, slow, never_scores, never = asyncio.run(run())
    finally:
        served.stop()
    assert scores == expected and any(score != FAILED for score in scores), scores
    assert slow_scores == [FAILED] * len(items) and slow.metrics()["rollout/judge_timeouts"] == len(items)
    assert never_scores == [FAILED] * len(items) and never.metrics()["rollout/judge_unparsable"] == len(items)


def test_a_discriminative_judge_scores_with_its_head(tmp_path):
    """A reward model (a tiny random Qwen3-MoE with a one-output sequence-classification head) on the
    embedded engine: each score is the head's output at the filled template's last token, as
    transformers computes it on the same ids."""
    import torch
    import transformers

    torch.manual_seed(5)
    hf = hf_config(TEACHER_MODEL, vocab_size=128, num_labels=1, pad_token_id=0)
    reward_model = transformers.Qwen3MoeForSequenceClassification(hf).eval()
    reward_model.save_pretrained(tmp_path / "rm")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_CHAT / name, tmp_path / "rm" / name)
    judge_config = config(tmp_path / "rm", kind="discriminative")
    served = ServedModel(judge_config.served, EngineConfig())
    items = [(f"1{d}", f"{d}{d}", str(d)) for d in range(4)]
    try:

        async def run():
            judge = Judge(judge_config, served.url())
            try:
                return await judge.score_group(items), [judge.prompt_ids(*item) for item in items]
            finally:
                await judge.close()

        scores, ids = asyncio.run(run())
    finally:
        served.stop()
    with torch.no_grad():
        expected = [float(reward_model(torch.tensor([row])).logits[0, 0]) for row in ids]
    assert scores == pytest.approx(expected, rel=1e-5, abs=1e-6) and len(set(scores)) > 1, (scores, expected)


def judged_run(tmp_path, judge: dict, steps: int) -> RunConfig:
    """A short sync run of copy_digits rewarded by `judge`, its samples dumped."""
    return from_dict(
        RunConfig,
        {
            "model": {"hf_config": TEACHER_MODEL},
            "trainer": {"world_size": 1, "micro_batch_size": 8, "global_batch_size": 8},
            "rollout": {
                "task": "copy_digits",
                "task_options": {"length": 2},
                "groups_per_step": 2,
                "n_samples_per_prompt": 4,
                "max_new_tokens": 2,
                "max_staleness": 0,
                "reward": "judge",
                "judge": {"template": TEMPLATE, "parse": PARSE, "failed_score": FAILED, **judge},
                "dump": True,
            },
            "rl": {"mode": "sync", "report": False, "save_hf": False},
            "steps": steps,
            "output_dir": str(tmp_path / "run"),
        },
    )


def test_a_run_logs_the_judges_parsed_scores_as_rewards(tmp_path, judge_dir):
    steps = 2
    run_config = judged_run(tmp_path, {"path": str(judge_dir)}, steps)
    preflight.check_run(run_config)
    from moe_rl.jobs import rl

    rl.run(run_config)
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert len(rows) == steps and all("rollout/judge_unparsable" in row for row in rows)
    records = [
        json.loads(line)
        for step in range(1, steps + 1)
        for line in open(tmp_path / "run" / "rollouts" / f"step_{step:06d}.jsonl")
    ]
    task = CopyDigits(length=2)
    served = ServedModel(run_config.rollout.judge.served, EngineConfig())
    try:

        async def predict():
            judge = Judge(run_config.rollout.judge, served.url())
            try:
                return [
                    await direct(
                        served.url(), judge, task.decode(r["prompt_ids"]), task.decode(r["response_ids"]), r["answer"]
                    )
                    for r in records
                ]
            finally:
                await judge.close()

        predicted = asyncio.run(predict())
    finally:
        served.stop()
    assert [r["reward"] for r in records] == predicted
    assert len(records) == steps * 8 and any(reward != FAILED for reward in predicted), predicted


def test_a_judge_that_times_out_is_counted_and_the_run_goes_on(tmp_path, judge_dir):
    run_config = judged_run(tmp_path, {"path": str(judge_dir), "timeout_s": 1e-4}, steps=1)
    from moe_rl.jobs import rl

    rl.run(run_config)
    (row,) = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    records = [json.loads(line) for line in open(tmp_path / "run" / "rollouts" / "step_000001.jsonl")]
    assert [r["reward"] for r in records] == [FAILED] * 8
    assert row["rollout/judge_timeouts"] >= 8 and row["rollout/judge_unparsable"] == row["rollout/judge_errors"] == 0
