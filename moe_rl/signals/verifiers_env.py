"""`rollout.environment: {kind: verifiers, name: <environment id>, options}`: a verifiers (0.4)
environment's tasks, played through moe-rl's OpenAI endpoint and scored by the tasks' own rewards.

- Loading: `vf.load_environment(vf.resolve_env_config({"taskset": {"id": name, **options}}))`,
  as verifiers' own `eval` and `serve` load it. `name` is the installed environment's module or
  hub id (`owner/name` imports `name`); `options` are its taskset config's fields (its split,
  its size), so an eval split is the same name with other options.
- Prompts: the taskset's tasks (a finite taskset shuffled by the seed, then cycled; an endless
  one in its order), each as chat messages: the task's `system_prompt`, then its `prompt` (text:
  one user message). The prompt's answer is the task's `idx`.
- Episodes: verifiers runs a task through a harness program that calls the model over HTTP;
  here the adapter's agent (`Task.agent`) is that program, in process: it sends the task's
  messages to the episode's `/v1/chat/completions` with the OpenAI SDK (`moe_rl.agents.endpoint`,
  token-in-token-out: tokens, versions and routing stay exact), one turn, as verifiers' chat
  harness does for a task without tools.
- Reward: the task's own scoring, `Task.score(trace)` (its `@vf.reward` functions, plugged
  rewards and judges, weighted, summed as `trace.reward`), on a `vf.Trace` of the episode's
  conversation, through the run's `RewardScorer` (`Episode.score`): a reward that raises or
  hangs scores 0, counted `rollout/reward_errors` / `reward_timeouts`.
- Refused before start: tasksets with tool servers (`toolsets`: MCP servers, which the harness
  serves) and rewards that need a runtime (a sandbox); a taskset that fails to import or load.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import itertools
import random
from typing import Any, Iterator

import verifiers.v1 as vf
from pydantic import TypeAdapter
from verifiers.v1.graph import MessageNode

from moe_rl.agents import Episode
from moe_rl.sample import Sample
from moe_rl.tasks import Prompt, Task

MESSAGE = TypeAdapter(vf.Message)


class VerifiersTask(Task):
    name = "verifiers"

    def __init__(self, env_id: str, options: dict[str, Any]):
        _import(env_id)
        self.env = vf.load_environment(vf.resolve_env_config({"taskset": {"id": env_id, **options}}))
        self.taskset = self.env.taskset
        task_type = type(self.taskset).task_type()
        if type(self.taskset).toolsets(self.taskset.config) or task_type.toolsets(self.taskset.config.task):
            raise ValueError(f"name={env_id!r} serves tools (MCP toolsets), which moe-rl does not serve yet")
        self.tasks: dict[int, vf.Task] = {}  # idx -> task, as prompts draw them (the reward looks them up)
        first = next(iter(self.taskset), None)
        if first is None:
            raise ValueError(f"name={env_id!r} with options {options}: the taskset has no tasks")
        needs = [fn.__name__ for fn in first.hooks("reward") if _needs_runtime(fn)]
        if needs:
            raise ValueError(f"name={env_id!r}: the rewards {needs} need a runtime (a sandbox), which moe-rl lacks")
        self.agent = self.play

    def prompts(self, seed: int) -> Iterator[Prompt]:
        if self.taskset.bounded:
            tasks = list(self.taskset)
            self.tasks.update((task.data.idx, task) for task in tasks)
            random.Random(seed).shuffle(tasks)
            source = itertools.cycle(tasks)
        else:
            source = iter(self.taskset)
        for task in source:
            self.tasks.setdefault(task.data.idx, task)  # an endless taskset's, as they are drawn
            yield Prompt(messages=task_messages(task), answer=task.data.idx, metadata={"key": task.key})

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError("verifiers environments run episodes; their text is the endpoint's")

    async def play(self, episode: Episode) -> float:
        """One episode: the task's messages, one model turn through the episode's OpenAI endpoint."""
        from openai import AsyncOpenAI  # a dependency of verifiers

        async with AsyncOpenAI(base_url=episode.base_url, api_key="-", max_retries=0) as client:
            await client.chat.completions.create(model="policy", messages=episode.messages)
        return await episode.score()

    def reward(self, response: str, answer: int, sample: Sample) -> float:
        """`Task.score` of the conversation (the episode's, or the prompt and `response` when a
        limit cut the episode): the sum of its weighted rewards."""
        task = self.tasks[answer]
        conversation = sample.metadata.get("conversation") or [
            *task_messages(task),
            {"role": "assistant", "content": response},
        ]
        trace = conversation_trace(task, conversation)
        asyncio.run(task.score(trace))  # a worker thread of the RewardScorer: its own loop
        return trace.reward


def task_messages(task: vf.Task) -> list[dict]:
    data = task.data
    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
    else:
        messages += [m.model_dump(exclude_none=True) for m in data.prompt or []]
    return messages


def conversation_trace(task: vf.Task, conversation: list[dict]) -> vf.Trace:
    """The trace verifiers' scoring reads: one branch of the conversation's messages, the
    assistant turns after the prompt marked sampled (`trace.last_reply` reads them)."""
    prompt = len(task_messages(task))
    nodes = [
        MessageNode(
            message=MESSAGE.validate_python(message),
            parent=i - 1 if i else None,
            sampled=i >= prompt and message["role"] == "assistant",
        )
        for i, message in enumerate(conversation)
    ]
    return vf.Trace(
        task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        agent=vf.AgentInfo(config=vf.AgentConfig()),
        nodes=nodes,
    )


def _import(env_id: str) -> None:
    """Import the environment's module as verifiers' loader names it, so that a failing import
    reports its own error (the loader reports any ModuleNotFoundError as "not found")."""
    module = env_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()
    if importlib.util.find_spec(f"verifiers.v1.tasksets.{module}") is not None:  # a built-in taskset
        return
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name != module:
            raise ValueError(f"name={env_id!r}: importing {module!r} failed ({error})") from None
        raise ValueError(
            f"name={env_id!r}: no module {module!r}: install the environment (its package, e.g. from the "
            "Environments Hub) or put its directory on PYTHONPATH"
        ) from None
    except Exception as error:  # the environment's own import failed
        raise ValueError(f"name={env_id!r}: importing {module!r} failed ({type(error).__name__}: {error})") from None


def _needs_runtime(fn) -> bool:
    parameter = inspect.signature(fn).parameters.get("runtime")
    return parameter is not None and parameter.default is inspect.Parameter.empty


def make_task(name: str, options: dict[str, Any], tokenizer_dir: str | None) -> VerifiersTask:
    return VerifiersTask(name, options)
