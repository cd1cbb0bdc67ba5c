"""Task and reward registries: where prompts come from and how a response is scored.

A `Task` gives a prompt source (`prompts(seed)` yields `Prompt`s), a `decode` from response ids
to text, and a verifiable `reward`. Built-in tasks register with `@register_task("name")`; user
data (JSONL, Parquet, a saved HF dataset) is the task `"dataset"` (`moe_rl.tasks.dataset`).
Rewards resolve by name with `get_reward`: a registered reward (`"math"`), a task name (that
task's own reward), or `"package.module:function"` (imported). Every reward has the signature
`reward(response: str, answer, sample: Sample) -> float` and runs in a worker thread, off the
rollout event loop.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Iterator

from moe_rl.sample import Sample

RewardFn = Callable[[str, Any, Sample], float]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prompt:
    """One prompt: its token ids (or, for agents, its chat messages and tools), the reference
    answer and free-form metadata."""

    prompt_ids: list[int] = dataclasses.field(default_factory=list)
    answer: Any = None
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    messages: list[dict] | None = None
    """Chat messages an agent episode starts from (rendered with the model's chat template)."""
    tools: list[dict] | None = None
    """OpenAI-style tool definitions given to the chat template."""

    def __post_init__(self):
        if not self.prompt_ids and not self.messages:
            raise ValueError("Prompt: give prompt_ids or chat messages")


class Task:
    """A prompt source plus a verifiable reward. Subclasses override the three methods."""

    name = "task"
    stop_token_ids: list[int] = []
    """Token ids that end a response (besides the model's EOS)."""

    def prompts(self, seed: int) -> Iterator[Prompt]:
        """Prompts in a seeded order; may be endless. The rollout manager draws from it."""
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        """Response ids -> the text the reward reads."""
        raise NotImplementedError

    def reward(self, response: str, answer: Any, sample: Sample) -> float:
        raise NotImplementedError


_TASKS: dict[str, Callable[..., Task]] = {}
_REWARDS: dict[str, RewardFn] = {}


def register_task(name: str):
    """Class decorator: `@register_task("copy_digits")` makes `make_task("copy_digits")` build it."""

    def add(cls):
        if name in _TASKS:
            raise ValueError(f"task {name!r} is registered twice")
        cls.name = name
        _TASKS[name] = cls
        return cls

    return add


def register_reward(name: str):
    """Function decorator: `@register_reward("math")` makes `get_reward("math")` return it."""

    def add(fn: RewardFn) -> RewardFn:
        if name in _REWARDS:
            raise ValueError(f"reward {name!r} is registered twice")
        _REWARDS[name] = fn
        return fn

    return add


def task_names() -> list[str]:
    return sorted(_TASKS)


def task_class(name: str) -> Callable[..., Task]:
    """The registered task class `name`."""
    if name not in _TASKS:
        raise ValueError(f"rollout.task={name!r} is not a registered task; use one of {task_names()}")
    return _TASKS[name]


def make_task(name: str, **kwargs) -> Task:
    """Build the registered task `name` with its keyword options."""
    return task_class(name)(**kwargs)


def get_reward(name: str) -> RewardFn:
    """A registered reward, a task's reward (by task name), or `module:function` imported."""
    if name in _REWARDS:
        return _REWARDS[name]
    if name in _TASKS:
        return _TASKS[name]().reward
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"rollout.reward={name!r}: use a registered reward {sorted(_REWARDS)}, a task name "
            f"{task_names()}, or 'package.module:function'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"rollout.reward={name!r}: cannot import {module_name!r} ({error})") from error
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"rollout.reward={name!r}: {module_name} has no function {attr!r}")
    return fn
