"""`RolloutConfig`: what the rollout manager generates, how it scores it and how stale it may get."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from moe_rl.agents.config import EpisodeConfig
from moe_rl.rollout.buffer import STALE_POLICIES
from moe_rl.signals.judge import JudgeConfig
from moe_rl.tasks import make_task


@dataclass(kw_only=True)
class RolloutConfig:
    task: str = "copy_digits"
    """A registered task (`moe_rl.tasks.task_names()`), or "package.module:Class" (a `Task` subclass of
    your own, docs/agents.md); "dataset" reads `rollout.dataset`."""
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
    (the served model `rollout.judge` scores, `moe_rl.signals.judge`)."""
    judge: JudgeConfig | None = None
    """With `reward: judge`: the judge, `{kind, path | url, template, parse, ...}` (docs/signals.md)."""
    agent: str | None = None
    """Multi-turn episodes: "package.module:function", an async function of an
    `moe_rl.agents.Episode` that returns the reward (docs/agents.md). None: single-turn samples."""
    episode: EpisodeConfig = field(default_factory=EpisodeConfig)
    """Limits and the OpenAI endpoint of agent episodes."""
    apply_chat_template: bool = False
    """task "dataset": render text prompts as one user message with the model's chat template and the
    generation prompt (rows whose prompt is a list of chat messages always are)."""
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
    """Reward calls that run at once, each on its own thread, off the event loop
    (`moe_rl.rollout.scoring`)."""
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
        if (self.task == "dataset") != (self.dataset is not None):
            raise ValueError("rollout.dataset goes with rollout.task='dataset': set both or neither")

    def make_task(self, tokenizer_dir: str | None = None):
        """The configured task (for "dataset": the dataset read and checked, text prompts tokenized
        with `tokenizer_dir`'s tokenizer, every row a chat when an agent drives the episodes)."""
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
                for_agents=self.agent is not None,
            )
        return make_task(self.task, **options)

    def sampling(self) -> dict[str, Any]:
        """The rollout's fields of every request's `moe_rl.engine.sampling.SamplingParams`."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}

    def replace(self, **changes) -> "RolloutConfig":
        return dataclasses.replace(self, **changes)
