"""`RolloutConfig`: what the rollout manager generates, how it scores it and how stale it may get.

The task fields (`TaskConfig`) are the rollout section's own for one task; a mixture
(`rollout.tasks`) lists them per entry (`MixtureEntry`) and leaves the section's unset.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from moe_rl.agents.config import EpisodeConfig
from moe_rl.rollout.buffer import STALE_POLICIES
from moe_rl.signals.config import JudgeConfig
from moe_rl.signals.environment import EnvironmentConfig, make_environment_task
from moe_rl.tasks import Task, get_reward, make_task
from moe_rl.tasks.mixture import MixturePart, TaskMixture
from moe_rl.tasks.registry import check_renamed

DEFAULT_TASK = "copy_digits"


@dataclass(kw_only=True)
class TaskConfig:
    """Where prompts come from and how responses are scored: the fields the rollout section and each
    entry of `rollout.tasks` share."""

    task: str | None = None
    """A registered task (`moe_rl.tasks.task_names()`), or "package.module:Class" (a `Task` subclass of
    your own, docs/agents.md); "dataset" reads `dataset`. Unset in the rollout section: copy_digits,
    unless `rollout.tasks` or `rollout.environment` gives the prompts."""
    task_options: dict[str, Any] = field(default_factory=dict)
    """Keyword options of the task, e.g. {"length": 3} for the digit tasks."""
    dataset: str | None = None
    """task="dataset": a .jsonl/.json or .parquet file, a directory of them, or a directory written by
    `Dataset.save_to_disk`; read with HF `datasets`, offline (`moe_rl.tasks.dataset`)."""
    prompt_key: str = "prompt"
    """Column of the prompt: text, or a list of chat messages (rendered with the chat template). A
    dotted path reaches into a nested column. Rows may give token ids in `prompt_ids` instead."""
    answer_key: str = "answer"
    """Column the reward compares the response with; verl's layout: "reward_model.ground_truth"."""
    tools_key: str = "tools"
    """Optional column of OpenAI function definitions (a list, or its JSON text), given to the chat
    template and kept on the prompt for agents."""
    metadata_keys: list[str] | None = None
    """Columns copied into each prompt's metadata (the `metadata` column's fields at its top level,
    others under their names). None: `metadata` if present, plus verl's `data_source`, `ability`,
    `extra_info` where present."""
    reward: str | None = None
    """None: the task's own reward; else "math", a task name, "package.module:function", or "judge"
    (the served model `rollout.judge` scores, `moe_rl.signals.judge`; not in a mixture's entries)."""
    apply_chat_template: bool = False
    """task "dataset": render text prompts as one user message with the model's chat template and the
    generation prompt (rows whose prompt is a list of chat messages always are)."""

    def check_task(self, where: str) -> None:
        """The task's fields agree (`where` names them in errors: "rollout", "rollout.tasks['x']")."""
        check_renamed(self.task, f"{where}.task")
        if (self.task == "dataset") != (self.dataset is not None):
            raise ValueError(f"{where}.dataset goes with {where}.task='dataset': set both or neither")

    def make_task(self, tokenizer_dir: str | None = None, for_agents: bool = False) -> Task:
        """The task (for "dataset": the dataset read and checked, text prompts tokenized with
        `tokenizer_dir`'s tokenizer, every row a chat `for_agents`)."""
        options = dict(self.task_options)
        if self.task == "dataset":
            options.update(
                path=self.dataset,
                tokenizer_dir=tokenizer_dir,
                reward="math" if self.reward in (None, "judge") else self.reward,  # a judge scores instead
                apply_chat_template=self.apply_chat_template,
                prompt_key=self.prompt_key,
                answer_key=self.answer_key,
                tools_key=self.tools_key,
                metadata_keys=self.metadata_keys,
                for_agents=for_agents,
            )
        return make_task(self.task, **options)


@dataclass(kw_only=True)
class MixtureEntry(TaskConfig):
    """One task of a mixture (`rollout.tasks`): a task's fields, its name and its weight."""

    name: str
    """Names the task's metrics (`rollout/task/<name>/...`) and its samples (`metadata["task"]`)."""
    weight: float = 1.0
    """Its share of the prompts: weight / the sum of the entries' weights."""

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name or "/" in self.name:
            raise ValueError(f"rollout.tasks: name={self.name!r} must be non-empty and without '/' (it names metrics)")
        if isinstance(self.weight, bool) or not (isinstance(self.weight, (int, float)) and 0 < self.weight < math.inf):
            raise ValueError(f"{self.field}.weight={self.weight!r}: must be a number > 0")
        if self.task is None:
            raise ValueError(f"{self.field}.task is unset: name the entry's task (e.g. copy_digits, dataset)")
        if self.reward == "judge":
            raise ValueError(
                f"{self.field}.reward='judge': a judge scores a single task's run; give the entry a reward"
            )
        self.check_task(self.field)

    @property
    def field(self) -> str:
        """How errors name this entry in the config."""
        return f"rollout.tasks[{self.name!r}]"

    def make_task(self, tokenizer_dir: str | None = None, for_agents: bool = False) -> Task:
        """The entry's task; a task's or dataset's error names this entry's fields."""
        try:
            return super().make_task(tokenizer_dir, for_agents)
        except ValueError as error:
            message = str(error).replace("rollout.", f"{self.field}.")
            raise ValueError(message if message.startswith(self.field) else f"{self.field}: {message}") from None

    def part(self, tokenizer_dir: str | None = None) -> MixturePart:
        """The entry as the mixture draws and scores it: weight, task, and its reward (`reward`, else
        the task's own)."""
        task = self.make_task(tokenizer_dir)
        reward = get_reward(self.reward, f"{self.field}.reward") if self.reward else task.reward
        return MixturePart(weight=float(self.weight), task=task, reward=reward)


@dataclass(kw_only=True)
class RolloutConfig(TaskConfig):
    tasks: list[MixtureEntry] | None = None
    """A mixture: prompts drawn from these tasks by weight, each entry a task's fields with a name and a
    weight (`moe_rl.tasks.mixture`); the task fields of the rollout section itself stay unset."""
    environment: EnvironmentConfig | None = None
    """Prompts and rewards from an environment hub's package: {kind: verifiers | openenv |
    reasoning_gym, name, options} (docs/signals.md); the run's prompt source, so `task` stays unset."""
    judge: JudgeConfig | None = None
    """With `reward: judge`: the judge, `{kind, path | url, template, parse, ...}` (docs/signals.md)."""
    agent: str | None = None
    """Multi-turn episodes: "package.module:function", an async function of an
    `moe_rl.agents.Episode` that returns the reward (docs/agents.md). None: single-turn samples."""
    episode: EpisodeConfig = field(default_factory=EpisodeConfig)
    """Limits and the OpenAI endpoint of agent episodes."""
    n_samples_per_prompt: int = 4
    """Responses per prompt (one GRPO group)."""
    groups_per_step: int = 4
    """Groups per training batch (one round of generation)."""
    max_new_tokens: int = 16
    """Response budget per sample, across all its partial segments."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1: the whole vocabulary."""
    max_staleness: int = 1
    """Trainer version minus the oldest token version allowed in a batch; 0 = synchronous RL."""
    stale_policy: str = "drop"
    """Groups over the bound at consumption: "drop" (count, replace with a fresh prompt) or
    "requeue" (count, regenerate the same prompt under the same group id)."""
    partial_rollout: bool = True
    """A request cut by an abort-mode pause is continued (prompt + partial response, remaining
    budget, new weights); False restarts it from the prompt and discards the partial tokens."""
    mask_stale_tokens: bool = False
    """Set loss_mask 0 on response tokens older than the newest weight version in their sample
    (only partial rollouts mix versions), so each sample trains on its newest-policy tokens;
    their logprobs and routing are kept. How old a sample may get is `max_staleness`'s."""
    return_routed_experts: bool = True
    """Ask engines for routed experts (routing replay needs them)."""
    drop_zero_variance_groups: bool = False
    """Drop groups whose samples all got the same reward (zero GRPO advantage) at generation,
    counted `dropped_zero_variance`, and start a fresh prompt in their place (DAPO's dynamic
    sampling): the batch keeps groups_per_step groups, all with a signal."""
    oversample_factor: float = 1.0
    """Start ceil(factor * groups_per_step) groups per round, keep the first groups_per_step that
    complete (and pass filters), abort and count the rest."""
    reward_workers: int = 2
    """Reward calls that run at once (per task of a mixture), each on its own thread, off the event
    loop (`moe_rl.rollout.scoring`)."""
    reward_timeout_s: float = 30.0
    """A reward call still running after this many seconds scores 0, counted
    `rollout/reward_timeouts` (a reward that raises scores 0, counted `rollout/reward_errors`)."""
    seed: int = 0
    """Seed of the prompt order."""
    dump: bool = False
    """Write the samples of every trained step to RUN_DIR/rollouts/step_NNNNNN.jsonl (.gz when over
    1 MiB): texts, token ids, reward, advantage, versions (`moe_rl.rollout.dump`; `moe-rl samples`)."""

    def __post_init__(self):
        positive = ("n_samples_per_prompt", "groups_per_step", "max_new_tokens", "reward_workers")
        for name in positive:
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"rollout.{name}={getattr(self, name)!r}: must be an integer >= 1")
        if not self.reward_timeout_s > 0:
            raise ValueError(
                f"rollout.reward_timeout_s={self.reward_timeout_s}: must be > 0 (seconds a reward call may run)"
            )
        if self.max_staleness < 0:
            raise ValueError(f"rollout.max_staleness={self.max_staleness}: must be >= 0 (0 = synchronous)")
        if self.stale_policy not in STALE_POLICIES:
            raise ValueError(f"rollout.stale_policy={self.stale_policy!r}: use one of {STALE_POLICIES}")
        if self.temperature < 0:
            raise ValueError(f"rollout.temperature={self.temperature}: must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p={self.top_p}: must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"rollout.top_k={self.top_k}: use -1 (all tokens) or >= 1")
        if self.oversample_factor < 1:
            raise ValueError(f"rollout.oversample_factor={self.oversample_factor}: must be >= 1")
        if self.drop_zero_variance_groups and self.n_samples_per_prompt < 2:
            raise ValueError("rollout.drop_zero_variance_groups needs rollout.n_samples_per_prompt >= 2")
        if (self.reward == "judge") != (self.judge is not None):
            raise ValueError("rollout.judge goes with rollout.reward='judge': set both or neither")
        if self.judge is not None and self.agent is not None:
            raise ValueError("rollout.judge with rollout.agent: an agent returns its episode's reward; drop one")
        if self.tasks is not None:
            self._check_mixture()
        elif self.environment is not None:
            fields = ("task", "task_options", "dataset", "agent", "reward")
            given = [f"rollout.{name}" for name in fields if getattr(self, name)]
            if given:
                raise ValueError(
                    f"{given[0]} with rollout.environment: the environment gives the prompts, the reward and its "
                    f"episodes; remove {', '.join(given)} (or rollout.environment)"
                )
        elif self.task is None:
            self.task = DEFAULT_TASK
        self.check_task("rollout")

    def _check_mixture(self) -> None:
        if not self.tasks:
            raise ValueError("rollout.tasks is empty: list {name, weight, task, ...} entries, or remove it")
        if self.environment is not None:
            raise ValueError(
                "rollout.environment with rollout.tasks: both give the run's prompts; keep one (an environment "
                "is not an entry of a mixture)"
            )
        if self.task is not None:
            raise ValueError(
                f"rollout.task={self.task!r} with rollout.tasks: a mixture's entries name their tasks; remove "
                "rollout.task (or make it an entry of rollout.tasks)"
            )
        for spec in dataclasses.fields(TaskConfig):
            if getattr(self, spec.name) != getattr(TaskConfig(), spec.name):
                raise ValueError(
                    f"rollout.{spec.name} with rollout.tasks: it belongs to one task; set it in its entry "
                    f"(rollout.tasks[i].{spec.name})"
                )
        names = [entry.name for entry in self.tasks]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"rollout.tasks: name {repeated[0]!r} is used twice; give every task its own name")
        if self.agent is not None:
            raise ValueError(
                "rollout.agent with rollout.tasks: a mixture's tasks are single-turn; remove rollout.agent, or "
                "train the agent's task alone (rollout.task)"
            )

    def task_configs(self) -> list[tuple[str, TaskConfig]]:
        """Each task's fields and how errors name them: the mixture's entries, or the rollout section."""
        if self.tasks is not None:
            return [(entry.field, entry) for entry in self.tasks]
        return [("rollout", self)]

    def mixture_signature(self) -> list[list] | None:
        """[[name, weight], ...] of `tasks` in order (None: one task): what a run checkpoint records
        of the mixture, and a resume must match (the prompt draws depend on it)."""
        return None if self.tasks is None else [[entry.name, float(entry.weight)] for entry in self.tasks]

    def make_task(self, tokenizer_dir: str | None = None) -> Task:
        """The run's prompt source: the task (every row a chat when an agent drives the episodes),
        the mixture of `tasks` (`moe_rl.tasks.mixture`), or the environment's (`moe_rl.signals`)."""
        if self.environment is not None:
            return make_environment_task(self.environment, tokenizer_dir, "rollout.environment")
        if self.tasks is not None:
            return TaskMixture({entry.name: entry.part(tokenizer_dir) for entry in self.tasks})
        return super().make_task(tokenizer_dir, for_agents=self.agent is not None)

    def sampling(self) -> dict[str, Any]:
        """The rollout's fields of every request's `moe_rl.engine.sampling.SamplingParams`."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}

    def replace(self, **changes) -> "RolloutConfig":
        return dataclasses.replace(self, **changes)
