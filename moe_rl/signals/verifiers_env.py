"""`rollout.environment: {kind: verifiers, name: <environment id>, options}`: a verifiers (0.4)
environment's tasks, played by verifiers itself through moe-rl's OpenAI endpoint and scored as
verifiers scores them.

- Loading: `vf.load_environment(vf.resolve_env_config({"taskset": {"id": name, **options},
  <seat>: ...}))`, as verifiers' own `eval` and `serve` load it: the taskset's own `Env` when it
  exports one (a game whose `run()` answers each move, as TextArena's does), else
  `SingleAgentEnv`. `name` is the installed environment's module or hub id (`owner/name` imports
  `name`); `options` are its taskset config's fields (its split, its size), so an eval split is
  the same name with other options. The env's one agent seat is the policy.
- Prompts: the taskset's tasks (a finite taskset shuffled by the seed, then cycled; an endless
  one in its order), each as chat messages: the task's `system_prompt`, then its `prompt` (text:
  one user message). The prompt's answer is the task's `idx`.
- Episodes: the adapter's agent (`Task.agent`) runs `Env.run_episode` with the model at the
  episode's `/v1/chat/completions` (`moe_rl.agents.endpoint`: token-in-token-out, so tokens,
  versions and routing stay exact). verifiers then does what its `eval` does: its env's turns,
  its interception server between the harness program and the model, the taskset's MCP tool
  servers (taskset-scoped ones started once per process, task-scoped ones per episode, each fed
  its task and state by the interception), and its chat harness, the `null` harness's program:
  turns with the tools until a reply without tool calls (`moe_rl.signals.verifiers_harness` runs
  that program with this interpreter instead of a `uv` environment). Programs and servers run in
  verifiers' local subprocess runtime. The seat's `max_turns` is `rollout.episode.max_turns`, so
  verifiers ends an episode there as its own limit; `max_context_tokens` cuts it in the endpoint.
- Reward: verifiers' scoring of its trace (the task's `@vf.reward` functions, plugged rewards and
  judges, and what the env's `run()` records, weighted, summed as `trace.reward`). An episode that
  verifiers could not finish (an error, or the context limit) is scored on the conversation the
  record holds: `Task.score` of a `vf.Trace` built from it (read by verifiers' chat dialect),
  through the run's `RewardScorer` (`Episode.score`), where a reward that raises or hangs scores
  0, counted `rollout/reward_errors` / `reward_timeouts`.
- Refused before start: environments of several agent seats (such as user-sim), tasksets that
  bring their own harness program or tool servers in a container runtime, rewards that need a
  runtime (a sandbox); a taskset that fails to import or load.
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
from verifiers.v1.clients import ModelContext
from verifiers.v1.configs.agent import agent_config_fields
from verifiers.v1.configs.client import EvalClientConfig
from verifiers.v1.dialects.chat import parse_message
from verifiers.v1.graph import MessageNode
from verifiers.v1.utils.loaders import default_harness_id

from moe_rl.agents import Episode
from moe_rl.sample import Sample
from moe_rl.signals.verifiers_harness import HARNESS_ID
from moe_rl.tasks import Prompt, Task


class VerifiersTask(Task):
    name = "verifiers"

    def __init__(self, env_id: str, options: dict[str, Any]):
        _import(env_id)
        if default_harness_id(env_id) != "bash":
            raise ValueError(
                f"name={env_id!r} brings its own harness program, which needs a container runtime; moe-rl "
                "plays verifiers tasks with verifiers' chat harness (the `null` harness's program)"
            )
        self.env_id, self.options = env_id, options
        seats = list(agent_config_fields(vf.resolve_env_config({"taskset": {"id": env_id, **options}})))
        if len(seats) != 1:
            raise ValueError(
                f"name={env_id!r} is an environment of {len(seats)} agents ({', '.join(seats)}); moe-rl trains "
                "verifiers environments with one agent seat (the policy)"
            )
        self.seat = seats[0]
        self.env = self._load(max_turns=None)
        self.taskset = self.env.taskset
        task_type = type(self.taskset).task_type()
        servers = type(self.taskset).toolsets(self.taskset.config) + task_type.toolsets(self.taskset.config.task)
        remote = [s.server_name for s in servers if s.config.url is None and s.config.runtime.type != "subprocess"]
        if remote:
            raise ValueError(
                f"name={env_id!r}: the tool servers {remote} run in a container runtime; moe-rl starts tool "
                "servers as local processes (their config's runtime: {type: subprocess}, or a url)"
            )
        self.tasks: dict[int, vf.Task] = {}  # idx -> task, as prompts draw them (the reward looks them up)
        first = next(iter(self.taskset), None)
        if first is None:
            raise ValueError(f"name={env_id!r} with options {options}: the taskset has no tasks")
        needs = [fn.__name__ for fn in first.hooks("reward") if _needs_runtime(fn)]
        if needs:
            raise ValueError(f"name={env_id!r}: the rewards {needs} need a runtime (a sandbox), which moe-rl lacks")
        self._played: vf.Env | None = None  # the env episodes run in (`_episodes`)
        self._serving: asyncio.Task | None = None  # holds its `Env.serving()` open on the rollout loop
        self._served: asyncio.Event | None = None
        self.agent = self.play

    def _load(self, max_turns: int | None) -> vf.Env:
        """The environment, its one seat played by moe-rl's harness in the local runtime."""
        seat = {"harness": {"id": HARNESS_ID}, "runtime": {"type": "subprocess"}, "max_turns": max_turns}
        config = {"taskset": {"id": self.env_id, **self.options}, self.seat: seat}
        return vf.load_environment(vf.resolve_env_config(config))

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
        """One episode: verifiers runs the task (its env's turns, the harness program, tool servers)
        against the episode's endpoint and scores its trace; when it could not finish (an error, or
        `rollout.episode.max_context_tokens` cut the conversation) the record's conversation is
        scored instead, through the run's scorer."""
        env = await self._episodes(episode.config.max_turns)
        model = ModelContext(model="policy", client=EvalClientConfig(base_url=episode.base_url, api_key_var=_NO_KEY))
        result = await env.run_episode(self.tasks[episode.answer], model)
        if result.ok and len(result.traces) == 1:
            return result.traces[0].reward
        return await episode.score()

    async def _episodes(self, max_turns: int) -> vf.Env:
        """The env episodes run in, its seat limited to `rollout.episode.max_turns` (so verifiers
        ends and scores an episode at the limit), with its `Env.serving()` (the interception server,
        taskset-scoped tool servers) entered once in a task of its own on this loop and held until
        the loop ends."""
        if self._played is None:
            self._played, self._served = self._load(max_turns), asyncio.Event()
            self._serving = asyncio.create_task(self._hold_serving(self._played, self._served))
        served = asyncio.create_task(self._served.wait())
        await asyncio.wait({served, self._serving}, return_when=asyncio.FIRST_COMPLETED)
        served.cancel()
        if self._serving.done():
            raise RuntimeError(f"verifiers could not serve the environment: {self._serving.exception()!r}")
        return self._played

    @staticmethod
    async def _hold_serving(env: vf.Env, served: asyncio.Event) -> None:
        async with env.serving():
            served.set()
            await asyncio.Event().wait()

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
    """The trace verifiers' scoring reads: one branch of the conversation's messages (OpenAI's
    form, read by verifiers' chat dialect), the assistant turns after the prompt marked sampled
    (`trace.last_reply` reads them)."""
    prompt = len(task_messages(task))
    nodes = [
        MessageNode(
            message=parse_message(message),
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


_NO_KEY = "MOE_RL_EPISODE_API_KEY"
"""The environment variable verifiers reads the endpoint's key from: unset, so it sends "EMPTY"
(the episode's URL is its credential)."""


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
