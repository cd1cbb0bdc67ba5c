"""Evaluation: the pass@k estimator, the eval config, and the `Evaluator` on a real embedded engine
whose weights are swapped in the middle of an evaluation."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from moe_rl.rollout.config import RolloutConfig
from moe_rl.rollout.eval_config import EvalConfig, EvalDatasetConfig
from moe_rl.rollout.evaluation import Evaluator, ks_of, pass_at_k
from moe_rl.tasks.digits import held_out


@pytest.mark.parametrize("n,c", [(1, 0), (1, 1), (4, 0), (4, 1), (4, 3), (6, 2), (8, 8), (5, 4)])
def test_pass_at_k_is_the_mean_over_every_k_subset(n, c):
    outcomes = [1] * c + [0] * (n - c)
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(outcomes, k))
        exact = sum(any(s) for s in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)


def test_reported_ks():
    assert ks_of(1) == [1]
    assert ks_of(4) == [1, 2, 4]
    assert ks_of(6) == [1, 2, 4, 6]


def test_eval_config_names_the_field_and_the_fix():
    cases = [
        (dict(datasets=[]), "eval.datasets is empty"),
        (dict(datasets=[dict(name="a", path="x.jsonl"), dict(name="a", path="y.jsonl")]), "'a' is used twice"),
        (dict(datasets=[dict(name="a")]), "set exactly one of path"),
        (dict(datasets=[dict(name="a", task="copy_digits")]), "set num_prompts"),
        (dict(datasets=[dict(name="a/b", path="x")]), "without '/'"),
        (dict(datasets=[dict(name="a", path="x", n_samples_per_prompt=0)]), "n_samples_per_prompt=0"),
        (dict(datasets=[dict(name="a", path="x")], every=-1), "eval.every=-1"),
    ]
    for fields, message in cases:
        with pytest.raises(ValueError, match=message):
            EvalConfig(**{**fields, "datasets": [EvalDatasetConfig(**d) for d in fields["datasets"]]})


def test_unset_fields_come_from_the_rollout_section():
    rollout = RolloutConfig(temperature=0.7, max_new_tokens=9, reward="math")
    resolved = EvalDatasetConfig(name="a", path="x", temperature=0.0).resolved(rollout)
    assert (resolved.temperature, resolved.max_new_tokens, resolved.reward, resolved.top_p) == (0.0, 9, "math", 1.0)


def test_due_steps():
    config = EvalConfig(datasets=[EvalDatasetConfig(name="a", path="x")], every=3, at_start=True)
    assert [s for s in range(0, 8) if config.due(s, last=7)] == [0, 3, 6, 7]
    assert not EvalConfig(datasets=[EvalDatasetConfig(name="a", path="x")], at_end=False).due(7, last=7)


def test_held_out_digit_strings_never_reach_training():
    from moe_rl.tasks import make_task

    train = make_task("copy_digits", length=2, split="train").prompts(0)
    evaluation = make_task("copy_digits", length=2, split="eval").prompts(0)
    assert not any(held_out(p.metadata["digits"]) for p in itertools.islice(train, 500))
    assert all(held_out(p.metadata["digits"]) for p in itertools.islice(evaluation, 200))
    with pytest.raises(ValueError, match="needs length >= 2"):
        make_task("copy_digits", length=1, split="eval")


@pytest.mark.world  # starts an embedded engine (tests/conftest.py)
def test_an_evaluation_cut_by_a_weight_swap_restarts_its_samples_whole(engine, model_dirs):
    from tests.rollout.rollout_helpers import make_pool, swap_weights

    prompts, n = 4, 2
    config = EvalConfig(
        datasets=[
            EvalDatasetConfig(
                name="heldout",
                task="copy_digits",
                task_options={"length": 2, "split": "eval"},
                num_prompts=prompts,
                n_samples_per_prompt=n,
                max_new_tokens=300,  # long enough to be in flight when the weights are swapped
            )
        ]
    )

    async def scenario():
        pool = make_pool(engine.url)
        evaluator = Evaluator(config, RolloutConfig(), pool)
        await evaluator.start()
        running = asyncio.create_task(evaluator.evaluate(step=0))
        while sum(pool.in_flight) < prompts * n:  # every sample's request is on the engine
            await asyncio.sleep(0.01)
        await swap_weights(pool, model_dirs[1], version=1, mode="abort")
        (result,) = await running
        await evaluator.close()
        await pool.close()
        return result

    result = asyncio.run(scenario())
    metrics, records = result.metrics, result.records
    assert len(records) == prompts * n
    assert metrics["eval/heldout/restarts"] >= 1  # the swap cut at least one sample
    for record in records:
        versions = {v for _, _, v in record["versions"]}
        assert len(versions) <= 1 and versions <= {0, 1}  # one version per sample
    assert metrics["eval/heldout/weight_version_max"] == 1
    for key in ("reward_mean", "pass@1", "pass@2", "mean@2", "truncation_rate", "response_length_mean", "seconds"):
        assert f"eval/heldout/{key}" in metrics
    rewards = [r["reward"] for r in records]
    assert metrics["eval/heldout/reward_mean"] == pytest.approx(sum(rewards) / len(rewards))
