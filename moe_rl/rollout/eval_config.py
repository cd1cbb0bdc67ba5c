"""`EvalConfig`: held-out evaluation during training (`eval:`) and by `moe-rl eval`.

Every field of an eval dataset left unset takes the rollout section's value (sampling, response
budget, reward, agent, dataset keys), so a held-out split of the training data needs only a name
and a path. `eval.every` counts trainer steps; an evaluation of version v runs on the rollout
engines next to generation (`moe_rl.rollout.evaluation`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from moe_rl.rollout.config import MixtureEntry, RolloutConfig, TaskConfig
from moe_rl.signals.environment import EnvironmentConfig, make_environment_task
from moe_rl.tasks import Task, make_task
from moe_rl.tasks.registry import RENAMED_TASKS

DATASET_KEYS = ("prompt_key", "answer_key", "tools_key", "metadata_keys")
INHERITED = ("temperature", "top_p", "top_k", "max_new_tokens", "reward", "agent", "apply_chat_template")
TASK_FIELDS = {f.name for f in dataclasses.fields(TaskConfig)}
"""Inherited fields that belong to a task: a mixture entry's own where the dataset evaluates one."""


@dataclass(kw_only=True)
class EvalDatasetConfig:
    name: str
    """Names the metrics (`eval/<name>/pass@4`) and the dump directory (`RUN_DIR/eval/<name>/`). With a
    mixture, a dataset named like an entry of `rollout.tasks` evaluates that task: it takes the
    entry's reward, dataset keys and chat template where unset, and its samples carry the task's name."""
    path: str | None = None
    """A dataset in any format `rollout.dataset` takes (JSONL, Parquet, a saved HF dataset); every
    row is evaluated once (or the first `num_prompts`)."""
    task: str | None = None
    """Instead of `path`: a registered task, e.g. copy_digits with task_options {split: eval}, or
    "package.module:Class"."""
    task_options: dict[str, Any] = field(default_factory=dict)
    """Options of `task`."""
    environment: EnvironmentConfig | None = None
    """Instead of `path` or `task`: an environment, as `rollout.environment` names one (e.g. the
    same one with its eval split's options); its own reward and episodes."""
    num_prompts: int | None = None
    """Prompts per evaluation: required with `task` (tasks may be endless); with `path`, at most
    this many rows (None: all)."""
    n_samples_per_prompt: int = 4
    """Samples per prompt: pass@k is reported for k = 1, 2, 4, ... up to this n."""
    pass_threshold: float = 1.0
    """A sample passes when its reward is at least this (rewards with partial credit)."""
    seed: int = 0
    """Order of the prompts (a dataset is shuffled by it; a task draws its prompts from it)."""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_new_tokens: int | None = None
    reward: str | None = None
    agent: str | None = None
    apply_chat_template: bool | None = None
    prompt_key: str | None = None
    answer_key: str | None = None
    tools_key: str | None = None
    metadata_keys: list[str] | None = None
    """Unset (None): the rollout section's value of the same name."""

    def __post_init__(self):
        where = f"eval.datasets[{self.name!r}]"
        if not self.name or "/" in self.name:
            raise ValueError(f"eval.datasets: name={self.name!r} must be non-empty and without '/' (it names metrics)")
        if self.task in ("dataset", *RENAMED_TASKS):  # the rollout section's names for a file of rows
            raise ValueError(f"{where}.task={self.task!r}: an eval dataset's file is its path; set path: FILE instead")
        if [self.path, self.task, self.environment].count(None) != 2:
            raise ValueError(
                f"{where}: set exactly one of path (a dataset file), task (a registered task) or environment"
            )
        if self.environment is not None and (self.agent or self.reward):
            raise ValueError(f"{where}: an environment runs its own episodes and reward: remove agent and reward")
        if self.path is None and self.num_prompts is None:
            raise ValueError(f"{where}: task {self.task or self.environment.name!r} may be endless: set num_prompts")
        for name in ("num_prompts", "n_samples_per_prompt", "max_new_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{where}.{name}={value!r}: must be an integer >= 1")
        if self.path is not None and self.task_options:
            raise ValueError(f"{where}: task_options go with task, not path; remove them")

    def resolved(self, rollout: RolloutConfig) -> "EvalDatasetConfig":
        """This dataset with every unset field taken from `rollout` (a task's fields from the mixture
        entry of the same name, `mixture_entry`; an environment keeps its own episodes and scorer)."""
        entry = self.mixture_entry(rollout)
        own = ("agent", "reward") if self.environment is not None else ()
        inherited = {
            name: getattr(rollout, name)
            for name in (*INHERITED, *DATASET_KEYS)
            if hasattr(rollout, name) and name not in own
        }
        if entry is not None:
            inherited.update({name: getattr(entry, name) for name in inherited if name in TASK_FIELDS})
        return dataclasses.replace(
            self, **{name: value for name, value in inherited.items() if getattr(self, name) is None}
        )

    def mixture_entry(self, rollout: RolloutConfig) -> MixtureEntry | None:
        """The `rollout.tasks` entry this dataset evaluates (named like it), None otherwise."""
        return next((entry for entry in rollout.tasks or [] if entry.name == self.name), None)

    @property
    def field(self) -> str:
        """How errors name this dataset in the config."""
        return f"eval.datasets[{self.name!r}]"

    def make_task(self, tokenizer_dir: str | None) -> Task:
        """The eval prompts' task (call on a `resolved` config); errors name this dataset's fields."""
        keys = {name: getattr(self, name) for name in DATASET_KEYS if getattr(self, name) is not None}
        if self.environment is not None:
            return make_environment_task(self.environment, tokenizer_dir, f"{self.field}.environment")
        try:
            if self.task is not None:
                return make_task(self.task, **self.task_options)
            return make_task(
                "dataset",
                path=self.path,
                tokenizer_dir=tokenizer_dir,
                reward=self.reward or "math",
                apply_chat_template=bool(self.apply_chat_template),
                for_agents=self.agent is not None,
                **keys,
            )
        except ValueError as error:
            raise ValueError(self.named(error)) from None

    def named(self, error: ValueError) -> str:
        """A task's or dataset's error, which names the rollout section's fields, for this dataset."""
        message = str(error).replace("rollout.dataset=", f"{self.field}.path=").replace("rollout.", f"{self.field}.")
        return message if message.startswith(self.field) else f"{self.field}: {message}"

    def sampling(self) -> dict[str, Any]:
        """The evaluation's fields of every request's `moe_rl.engine.sampling.SamplingParams` (on a
        `resolved` config)."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}


@dataclass(kw_only=True)
class EvalConfig:
    datasets: list[EvalDatasetConfig]
    """The held-out sets, each with its own metrics and dumps."""
    every: int = 0
    """Evaluate every this many trainer steps (the policy of that version); 0: only at_start/at_end."""
    at_start: bool = False
    """Evaluate the initial policy (version 0) before the first step."""
    at_end: bool = True
    """Evaluate the final policy once training ends (the run waits for it)."""
    hold_sync: bool = False
    """Hold the next weight sync until a running evaluation ends (the trainer goes on training but
    waits for it before syncing): no eval sample is cut and restarted, at the cost of that wait.
    For long responses, where syncs would cut eval samples faster than they finish. `rl.mode:
    sync` always holds."""
    dump: bool = True
    """Write every eval sample under `RUN_DIR/eval/<name>/step_N.jsonl` (`moe-rl samples --eval NAME`)."""

    def __post_init__(self):
        if not self.datasets:
            raise ValueError("eval.datasets is empty: list at least one {name, path} (or remove the eval section)")
        names = [d.name for d in self.datasets]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"eval.datasets: name {repeated[0]!r} is used twice; give every dataset its own name")
        if not isinstance(self.every, int) or self.every < 0:
            raise ValueError(f"eval.every={self.every!r}: must be an integer >= 0 (0: only at_start/at_end)")

    def due(self, step: int, last: int) -> bool:
        """Whether the policy of version `step` (after `step` trainer steps) is evaluated."""
        if step == 0:
            return self.at_start
        return (self.every and step % self.every == 0) or (self.at_end and step == last)
