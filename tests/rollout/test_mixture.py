"""Task mixtures (`rollout.tasks`, `moe_rl.tasks.mixture`): the draw ratio within a binomial bound,
each task's prompts in its own order, per-task batch metrics, eval inheritance, and the refusals.
The RL loop with a mixture (metrics, dumps, resume) is tests/rl/test_rl_mixture.py."""

from __future__ import annotations

import itertools
import math

import pytest

from moe_rl.config import load_config
from moe_rl.rollout import RolloutConfig
from moe_rl.rollout.config import MixtureEntry
from moe_rl.rollout.eval_config import EvalDatasetConfig
from moe_rl.rollout.train_batch import BatchInfo
from moe_rl.tasks import make_task
from moe_rl.tasks.digits import CopyDigits, ReverseDigits
from moe_rl.tasks.mixture import TaskMixture

DEMO = "configs/demo_cpu.yaml"
MIXTURE = "rollout.tasks=[{name: copy, task: copy_digits, weight: 3, task_options: {length: 2}}, " + (
    "{name: rev, task: reverse_digits, task_options: {length: 2}, reward: copy_digits}]"
)
SINGLE_TASK_OFF = ["rollout.task=null", "rollout.task_options={}"]  # the demo's own task fields


def mixture(**fields) -> RolloutConfig:
    return load_config(DEMO, [*SINGLE_TASK_OFF, MIXTURE, *(f"rollout.{k}={v}" for k, v in fields.items())]).rollout


def hoeffding_bound(n: int, failure: float) -> float:
    """t with P(|count/n - p| >= t) <= failure for n independent draws (Hoeffding: 2 exp(-2 n t^2))."""
    return math.sqrt(math.log(2 / failure) / (2 * n))


def test_prompts_are_drawn_by_weight_within_the_binomial_bound():
    n, failure = 4000, 1e-9
    bound = hoeffding_bound(n, failure)  # 0.054: a share off by more has probability < 1e-9 per seed
    task = mixture().make_task()
    for seed in range(3):
        draws = list(itertools.islice(task.prompts(seed), n))
        share = sum(p.task == "copy" for p in draws) / n
        assert abs(share - 0.75) < bound, (seed, share)
        assert {p.task for p in draws} == {"copy", "rev"}


def test_each_task_gives_its_own_prompts_in_its_own_order():
    config = mixture()
    draws = list(itertools.islice(config.make_task().prompts(7), 200))
    for name, task in [("copy", "copy_digits"), ("rev", "reverse_digits")]:
        own = [p for p in draws if p.task == name]
        alone = list(itertools.islice(make_task(task, length=2).prompts(7), len(own)))
        assert [(p.prompt_ids, p.answer) for p in own] == [(p.prompt_ids, p.answer) for p in alone]
    # the same seed draws the same sequence (what a resume replays)
    again = list(itertools.islice(config.make_task().prompts(7), 200))
    assert [(p.task, p.prompt_ids) for p in again] == [(p.task, p.prompt_ids) for p in draws]


def test_each_entry_scores_with_its_own_reward():
    config = mixture()
    task = config.make_task()
    assert isinstance(task, TaskMixture) and config.mixture_signature() == [["copy", 3.0], ["rev", 1.0]]
    copy, rev = task.parts["copy"], task.parts["rev"]
    assert copy.reward.__self__ is copy.task  # no reward set: the task's own
    assert isinstance(rev.task, ReverseDigits) and isinstance(rev.reward.__self__, CopyDigits)  # reward: copy_digits
    prompt = next(p for p in task.prompts(0) if p.task == "rev")
    assert prompt.answer == "".join(map(str, reversed(prompt.metadata["digits"])))


def test_batch_metrics_are_also_logged_per_task():
    info = BatchInfo(
        group_ids=["g0-0", "g0-1"],
        rewards=[1.0, 0.5, 0.0, 0.25],
        response_lengths=[2, 2, 1, 3],
        staleness=[0, 1, 1, 1],
        segments=[1, 2, 1, 1],
        tasks=["copy", "copy", "rev", "rev"],
    )
    metrics = info.metrics()
    assert metrics["rollout/reward_mean"] == 0.4375 and metrics["rollout/samples"] == 4
    assert metrics["rollout/task/copy/reward_mean"] == 0.75 and metrics["rollout/task/rev/reward_mean"] == 0.125
    assert metrics["rollout/task/copy/reward_max"] == 1.0 and metrics["rollout/task/rev/response_length_max"] == 3
    assert metrics["rollout/task/copy/partial_samples"] == 1 and metrics["rollout/task/rev/staleness_mean"] == 1.0
    assert metrics["rollout/task/copy/samples"] == metrics["rollout/task/rev/samples"] == 2
    single = BatchInfo(group_ids=["g"], rewards=[1.0], response_lengths=[1], staleness=[0], segments=[1], tasks=[None])
    assert not any(key.startswith("rollout/task/") for key in single.metrics())


def test_an_eval_dataset_named_like_an_entry_evaluates_that_task():
    rollout = mixture()
    named = EvalDatasetConfig(name="rev", task="reverse_digits", num_prompts=4)
    assert named.mixture_entry(rollout).name == "rev"
    assert named.resolved(rollout).reward == "copy_digits"  # the entry's, not the rollout section's
    other = EvalDatasetConfig(name="heldout", task="reverse_digits", num_prompts=4)
    assert other.mixture_entry(rollout) is None and other.resolved(rollout).reward is None


def test_a_mixture_leaves_rollout_task_unset_and_refusals_name_the_fix():
    assert mixture().task is None and RolloutConfig().task == "copy_digits"
    refusals = [
        ([MIXTURE], "rollout.task='copy_digits' with rollout.tasks: .* remove rollout.task"),
        (
            [*SINGLE_TASK_OFF, MIXTURE, "rollout.reward=math"],
            r"rollout.reward with rollout.tasks: .*rollout.tasks\[i\]",
        ),
        ([*SINGLE_TASK_OFF, "rollout.tasks=[]"], "rollout.tasks is empty"),
        ([*SINGLE_TASK_OFF, "rollout.tasks=[{name: a, task: copy_digits}, {name: a, task: sum_mod10}]"], "used twice"),
        ([*SINGLE_TASK_OFF, "rollout.tasks=[{name: a, task: copy_digits, weight: 0}]"], r"\['a'\].weight=0.0"),
        ([*SINGLE_TASK_OFF, "rollout.tasks=[{name: a/b, task: copy_digits}]"], "without '/'"),
        ([*SINGLE_TASK_OFF, "rollout.tasks=[{name: a}]"], r"rollout.tasks\['a'\].task is unset"),
        ([*SINGLE_TASK_OFF, MIXTURE, "rollout.agent=m:f"], "rollout.agent with rollout.tasks"),
        (
            [*SINGLE_TASK_OFF, "rollout.tasks=[{name: m, task: dataset}]"],
            r"rollout.tasks\['m'\].dataset goes with rollout.tasks\['m'\].task='dataset'",
        ),
    ]
    for overrides, message in refusals:
        with pytest.raises(ValueError, match=message):
            load_config(DEMO, overrides)
    missing = RolloutConfig(tasks=[MixtureEntry(name="m", task="dataset", dataset="/nonexistent.jsonl")])
    with pytest.raises(ValueError, match=r"^rollout.tasks\['m'\].dataset='/nonexistent.jsonl': no such file"):
        missing.make_task()


@pytest.mark.parametrize("where", ["rollout", "rollout.tasks['a']"])
def test_the_old_task_name_jsonl_is_refused_naming_dataset(where):
    overrides = ["rollout.task=jsonl", "rollout.dataset=data.jsonl"]
    if where != "rollout":
        overrides = [*SINGLE_TASK_OFF, "rollout.tasks=[{name: a, task: jsonl, dataset: data.jsonl}]"]
    field = where.replace("[", r"\[").replace("]", r"\]")
    with pytest.raises(
        ValueError, match=rf"^{field}.task='jsonl': the task 'jsonl' is now 'dataset'; set {field}.task: dataset$"
    ):
        load_config(DEMO, overrides)
    with pytest.raises(ValueError, match="is now 'dataset'"):
        make_task("jsonl")
    with pytest.raises(ValueError, match=r"eval.datasets\['h'\].task='jsonl': an eval dataset's file is its path"):
        EvalDatasetConfig(name="h", task="jsonl", num_prompts=1)


def test_the_reward_plot_draws_each_task_of_a_mixture():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moe_rl.report import _reward

    rows = [
        {"step": s, "rollout/reward_mean": 0.5, "rollout/task/copy/reward_mean": 0.75}
        | ({"rollout/task/rev/reward_mean": 0.25} if s % 2 else {})
        for s in range(1, 41)
    ]
    fig, ax = plt.subplots()
    assert _reward(ax, rows)
    lines = {line.get_label(): line.get_xydata() for line in ax.get_lines()}
    plt.close(fig)
    assert list(lines) == ["mean reward", "moving average (2)", "task copy (2)", "task rev (1)"]
    assert lines["task rev (1)"][:, 0].tolist() == list(range(1, 41, 2))  # its own steps only
    assert set(lines["task copy (2)"][:, 1]) == {0.75}
