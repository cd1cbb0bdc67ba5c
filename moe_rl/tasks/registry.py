"""Task and reward registries: where prompts come from and how a response is scored.

A `Task` gives a prompt source (`prompts(seed)` yields `Prompt`s), a `decode` from response ids
to text, and a verifiable `reward`. Built-in tasks register with `@register_task("name")`; user
data (JSONL, Parquet, a saved HF dataset) is the task `"dataset"` (`moe_rl.tasks.dataset`).
Tasks resolve by name with `task_class`: a registered name, or `"package.module:Class"` (a `Task`
subclass, imported); an old name (`RENAMED_TASKS`) is refused naming the new one. Rewards
resolve with `get_reward`: a registered reward (`"math"`), a task name (that task's own reward),
or `"package.module:function"` (imported). Every reward has the signature
`reward(response: str, answer, sample: Sample) -> float` and runs in a worker thread, off the
rollout event loop.

User code (`rollout.task`, `rollout.reward`, `rollout.agent`) is imported by `import_object`, in
every process that uses it: the driver's checks before start, then the rollout actor. A module
imports there from PYTHONPATH or from the directory `moe-rl` runs in (the CLI puts it on
`sys.path`, and Ray puts the driver's working directory on every worker's).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
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
    task: str | None = None
    """The `rollout.tasks` entry the prompt was drawn for (`moe_rl.tasks.mixture`); None otherwise."""

    def __post_init__(self):
        if not self.prompt_ids and not self.messages:
            raise ValueError("Prompt: give prompt_ids or chat messages")


class Task:
    """A prompt source plus a verifiable reward. Subclasses override the three methods."""

    name = "task"
    stop_token_ids: list[int] = []
    """Token ids that end a response (besides the model's EOS)."""
    agent: Callable | None = None
    """An async function of an `Episode` that drives this task's episodes itself (an environment's
    adapter, `moe_rl.signals`), used when `rollout.agent` is unset; None: single-turn samples."""

    def prompts(self, seed: int) -> Iterator[Prompt]:
        """Prompts in a seeded order; may be endless. The rollout manager draws from it."""
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        """Response ids -> the text the reward reads."""
        raise NotImplementedError

    def reward(self, response: str, answer: Any, sample: Sample) -> float:
        raise NotImplementedError


RENAMED_TASKS = {"jsonl": "dataset"}
"""Old task names -> their new ones (a config naming an old one is refused with the new name)."""

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


def import_object(spec: str, field: str, wants: str) -> Any:
    """`package.module:attribute` imported; ValueError naming `field`, what it `wants` and the fix
    (module not found, failing on import, attribute missing). The caller checks the kind."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{field}={spec!r}: use 'package.module:name' ({wants})")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name != module_name and not module_name.startswith(f"{error.name}."):
            raise ValueError(f"{field}={spec!r}: importing {module_name!r} failed ({error})") from error
        raise ValueError(
            f"{field}={spec!r}: cannot import {module_name!r} ({error}): put the directory that holds it on "
            "PYTHONPATH, or run moe-rl from that directory"
        ) from error
    except Exception as error:  # the user's module raised while importing (a syntax error, a failing import)
        reason = f"{type(error).__name__}: {error}"
        raise ValueError(f"{field}={spec!r}: importing {module_name!r} failed ({reason})") from error
    value: Any = module
    for part in attr.split("."):
        if not hasattr(value, part):
            raise ValueError(f"{field}={spec!r}: {module_name} ({module.__file__}) has no {attr!r} ({wants})")
        value = getattr(value, part)
    return value


def check_renamed(name: str | None, field: str = "rollout.task") -> None:
    """ValueError when `name` is an old task name (`RENAMED_TASKS`), naming the new one."""
    if name in RENAMED_TASKS:
        raise ValueError(
            f"{field}={name!r}: the task {name!r} is now {RENAMED_TASKS[name]!r}; set {field}: {RENAMED_TASKS[name]}"
        )


def task_class(name: str, field: str = "rollout.task") -> Callable[..., Task]:
    """The registered task class `name`, or the `Task` subclass `package.module:Class`."""
    check_renamed(name, field)
    if ":" in name:
        cls = import_object(name, field, "a moe_rl.tasks.Task subclass")
        if not (isinstance(cls, type) and issubclass(cls, Task)):
            raise ValueError(f"{field}={name!r} is {_kind(cls)}, not a subclass of moe_rl.tasks.Task")
        return cls
    if name not in _TASKS:
        raise ValueError(
            f"{field}={name!r} is not a registered task; use one of {task_names()}, or 'package.module:Class' "
            "for a Task subclass of your own"
        )
    return _TASKS[name]


def make_task(name: str, **kwargs) -> Task:
    """Build the task `name` (registered, or `package.module:Class`) with its keyword options."""
    return task_class(name)(**kwargs)


def get_reward(name: str, field: str = "rollout.reward") -> RewardFn:
    """A registered reward, a task's reward (by task name), or `package.module:function` imported:
    a plain function (it runs on a worker thread, not the event loop) of (response, answer, sample)."""
    if name in _REWARDS:
        return _REWARDS[name]
    if name in _TASKS:
        return _TASKS[name]().reward
    if ":" not in name:
        raise ValueError(
            f"{field}={name!r}: use a registered reward {sorted(_REWARDS)}, a task name "
            f"{task_names()}, or 'package.module:function'"
        )
    wants = "a function reward(response, answer, sample) -> float"
    fn = import_object(name, field, wants)
    if isinstance(fn, type) or not callable(fn):
        raise ValueError(f"{field}={name!r} is {_kind(fn)}; give {wants}")
    if inspect.iscoroutinefunction(fn):
        raise ValueError(f"{field}={name!r} is an async function; rewards run on worker threads: give a plain def")
    try:
        inspect.signature(fn).bind("response", "answer", "sample")
    except TypeError:
        raise ValueError(f"{field}={name!r} takes {inspect.signature(fn)}; give {wants}") from None
    except ValueError:  # no signature to read (some builtins): called as it is
        pass
    return fn


def _kind(value: Any) -> str:
    """How an error names what a user's name resolved to."""
    if isinstance(value, type):
        return f"the class {value.__qualname__}"
    if inspect.isroutine(value):
        return f"the function {value.__qualname__}"
    return f"an object of type {type(value).__name__}"


def resolve_agent(name: str, field: str = "rollout.agent") -> Callable:
    """`package.module:function` -> the async agent function (ValueError naming the fix)."""
    wants = "an async function of an Episode (async def agent(episode))"
    fn = import_object(name, field, wants)
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"{field}={name!r} is not an async function: give {wants}")
    return fn
