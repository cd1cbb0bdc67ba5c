"""`AgentRunner`: runs one group's episodes through an agent function, with limits and outcomes.

An agent is a plain async function, named `package.module:function` in `rollout.agent`:

    async def agent(episode: Episode) -> float | None

called once per episode with its handle (`moe_rl.agents.episode`). It returns the reward, or sets
`episode.reward` and returns None; it may put its own figures in `episode.metrics` (numbers or
bools by name), logged per step as their mean over the episodes (`agents/metric/<name>`). A group
is `rollout.n_samples_per_prompt` episodes of one prompt, run concurrently on the rollout loop;
each ends one of four ways:
- completed: the agent returned a reward (a finite number);
- truncated: a limit (`max_turns`, `max_context_tokens`) ended it: the episode keeps its tokens
  and is scored by the task's reward on its last turn's text (`Task.reward`, through the
  `score` callable: off the loop, e.g. `RewardScorer.score_blocking`);
- `agent_error`: the agent raised or returned something that is not a reward;
- `agent_timeout`: it ran past `rollout.episode.timeout_s` (the agent is cancelled).
A group with an `agent_error` or `agent_timeout` episode is dropped with that reason (its round
starts a fresh prompt in its place); the message is logged and kept in `failures`. The run stops
only when every episode so far failed, over two rounds' worth of groups (`check_alive`).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import math
import time
from typing import Any, Awaitable, Callable

from moe_rl.agents.chat import ChatFormat
from moe_rl.agents.config import EpisodeConfig
from moe_rl.agents.endpoint import ChatEndpoint
from moe_rl.agents.episode import Episode, EpisodeLimit, EpisodeSetting, TurnFn
from moe_rl.sample import Sample

log = logging.getLogger(__name__)
AgentFn = Callable[[Episode], Awaitable[Any]]
STATS = ("turns", "tool_calls", "tool_errors", "forks", "replayed_turns", "generate_s", "env_s", "truncated")


class AgentFailure(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason, self.message = reason, message


class AgentRunner:
    def __init__(
        self,
        agent: AgentFn,
        chat: ChatFormat,
        config: EpisodeConfig,
        *,
        max_new_tokens: int,
        score: Callable[[str, Any, Sample], float],
        endpoint=None,
    ):
        self.agent, self.chat, self.config = agent, chat, config
        self.max_new_tokens, self.score, self.endpoint = max_new_tokens, score, endpoint
        self.tool_pool = concurrent.futures.ThreadPoolExecutor(config.tool_workers, thread_name_prefix="tool")
        self.setting = EpisodeSetting(chat, config, max_new_tokens, self.tool_pool, score)
        self.open: dict[str, list[Episode]] = {}  # group id -> its running episodes (run checkpoints)
        self.totals = collections.Counter()
        self._reported = collections.Counter()  # totals at the previous `metrics()`
        # the agents' own metrics: name -> [sum, episodes that set it], and at the previous `metrics()`
        self.agent_metrics: dict[str, list[float]] = {}
        self._agent_reported: dict[str, list[float]] = {}
        self.failures: list[str] = []  # the latest failure messages
        self.succeeded = self.failed_groups = 0

    @classmethod
    def for_agent(
        cls,
        agent: AgentFn,
        tokenizer_dir,
        config: EpisodeConfig,
        *,
        max_new_tokens: int,
        score: Callable[[str, Any, Sample], float],
    ) -> "AgentRunner":
        """The runner of `agent` (resolved by `moe_rl.tasks.registry.resolve_agent`) with the model's
        chat format (from `tokenizer_dir`) and an OpenAI endpoint per `config`."""
        chat = ChatFormat.load(
            tokenizer_dir, config.tool_call_format, config.reasoning_parser, config.chat_template_kwargs
        )
        endpoint = ChatEndpoint(config.endpoint_host, config.endpoint_port)
        return cls(agent, chat, config, max_new_tokens=max_new_tokens, score=score, endpoint=endpoint)

    def close(self) -> None:
        self.tool_pool.shutdown(wait=False, cancel_futures=True)

    async def run_group(
        self, gid: str, prompt, n: int, turn: TurnFn, replay: list[list[dict]] | None = None
    ) -> list[Sample]:
        """The group's samples (every sequence of its `n` episodes), or AgentFailure."""
        episodes = [
            Episode(
                group_id=gid,
                index=i,
                messages=prompt.messages,
                tools=prompt.tools,
                answer=prompt.answer,
                metadata={"prompt": prompt.metadata},
                setting=self.setting,
                turn=turn,
                replay=replay[i] if replay else None,
            )
            for i in range(n)
        ]
        self.open[gid] = episodes
        try:
            results = await asyncio.gather(*(self._run(e) for e in episodes), return_exceptions=True)
        finally:
            self.open.pop(gid, None)
        failures = [r for r in results if isinstance(r, AgentFailure)]
        errors = [r for r in results if isinstance(r, BaseException) and not isinstance(r, AgentFailure)]
        if errors:  # the engine or the rollout itself failed: not the agent's fault
            raise errors[0]
        if failures:
            self.failed_groups += 1
            self.failures = (self.failures + [f"group {gid}: {f}" for f in failures])[-8:]
            self.totals[f"dropped_{failures[0].reason}"] += 1
            raise failures[0]
        self.succeeded += n
        return [s for samples in results for s in samples]

    async def _run(self, episode: Episode) -> list[Sample]:
        if self.endpoint is not None:
            episode.base_url = await self.endpoint.open(episode)
        start = time.perf_counter()
        try:
            try:
                result = await asyncio.wait_for(self.agent(episode), self.config.timeout_s)
            except EpisodeLimit:
                result = None
            except asyncio.TimeoutError:
                raise AgentFailure("agent_timeout", f"episode {episode.index} ran past {self.config.timeout_s} s")
            except Exception as error:
                if episode.engine_error is not None:  # an engine failed the turn: the run's error
                    raise episode.engine_error from error
                if not episode.truncated:
                    log.warning("agent error in group %s: %r", episode.group_id, error, exc_info=error)
                    raise AgentFailure("agent_error", f"episode {episode.index} raised {error!r}") from error
                result = None  # the agent met a limit (e.g. through the endpoint) and gave up
        finally:
            if self.endpoint is not None:
                self.endpoint.close(episode)
        if episode.current is None:
            raise AgentFailure("agent_error", f"episode {episode.index} ended without a model turn")
        if episode.truncated and result is None and episode.reward is None:
            # off the loop: `score` blocks (a `RewardScorer.score_blocking` returns within its limit)
            episode.reward = float(
                await asyncio.to_thread(self.score, episode.last_text, episode.answer, episode.current)
            )
        reward = result if result is not None else episode.reward
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise AgentFailure(
                "agent_error", f"episode {episode.index} returned {result!r} and set reward={episode.reward!r}"
            )
        episode.reward = float(reward)
        episode.metrics = _checked_metrics(episode)
        for name, value in episode.metrics.items():
            total = self.agent_metrics.setdefault(name, [0.0, 0])
            total[0], total[1] = total[0] + value, total[1] + 1
        for key, value in episode.stats(time.perf_counter() - start).items():
            self.totals[key] += value
        self.totals["episodes"] += 1
        return episode.samples()

    def check_alive(self, groups_per_step: int) -> None:
        """Raise once every episode so far failed, over two rounds' worth of groups."""
        if self.succeeded == 0 and self.failed_groups >= 2 * groups_per_step:
            raise RuntimeError(
                f"every agent episode failed ({self.failed_groups} groups so far); the latest: "
                + " | ".join(self.failures[-3:])
            )

    def snapshot(self, gid: str) -> list[list[dict]]:
        """Per episode of an open group: its finished turns (see `Episode.log`)."""
        return [list(e.log) for e in self.open.get(gid, [])]

    def metrics(self) -> dict[str, float]:
        """The episodes finished since the previous call (the RL job calls it once a step): their
        count, means per episode (absent when none finished), truncations, forks, dropped groups
        and the mean of each of the agents' own metrics (absent when no episode set it)."""
        window = self.totals - self._reported
        window.update({key: 0 for key in self.totals if key not in window})  # Counter subtraction drops zeros
        self._reported = collections.Counter(self.totals)
        n = window["episodes"]
        out = {f"agents/{key}_per_episode": window[key] / n for key in STATS if key != "truncated" and n}
        out["agents/episodes"] = n
        out["agents/truncated_episodes"] = window["truncated"]
        out["agents/forked_sequences"] = window["forks"]
        out["agents/dropped_agent_error"] = window["dropped_agent_error"]
        out["agents/dropped_agent_timeout"] = window["dropped_agent_timeout"]
        for name, (total, episodes) in self.agent_metrics.items():
            before, since = self._agent_reported.get(name, (0.0, 0))
            if episodes > since:
                out[f"agents/metric/{name}"] = (total - before) / (episodes - since)
        self._agent_reported = {name: list(total) for name, total in self.agent_metrics.items()}
        return out


def _checked_metrics(episode: Episode) -> dict[str, float]:
    """`episode.metrics` as floats, or AgentFailure naming the entry that is not a finite number."""
    out = {}
    for name, value in episode.metrics.items():
        number = float(value) if isinstance(value, (bool, int, float)) else math.nan
        if not isinstance(name, str) or not name or not math.isfinite(number):
            raise AgentFailure(
                "agent_error",
                f"episode {episode.index} set metrics[{name!r}] = {value!r}: give a finite number under a string name",
            )
        out[name] = number
    return out
