"""`Episode`: one multi-turn trajectory, the handle an agent function drives.

Owns the episode record (the multi-turn `Sample` contract of `moe_rl.sample`):
- A sequence is one `Sample`: the prompt, then model segments (loss mask 1, engine logprobs,
  per-token weight versions) and environment segments (tool results, user turns, the chat
  template's glue: loss mask 0, logprob 0.0, version None). Routed experts cover every position:
  each turn is one engine request on the record's ids plus the new environment ids, with
  `routed_experts_start_len` = the rows already held, so the engine's prefill of the
  environment tokens brings their rows and no row arrives twice.
- Environment ids wait in `pending` until the next turn's prefill routes them; ids that no turn
  ever reads (after the last turn) are not part of the sequence (they would have no routing and
  they affect no trained token).
- Token-in-token-out (`moe_rl.agents.chat`): a call whose messages extend the recorded
  conversation appends only the new ids; one that rewrites it starts a new sequence of the same
  episode (`sequences`, counted `forks`), trained as its own sample with the episode's reward.
- Limits: `max_turns` and `max_context_tokens` end the episode truncated (`EpisodeLimit` raised
  from `generate`), its tokens kept.
- Replay: an episode restored from a run checkpoint re-runs its agent; each `generate` whose
  request equals a recorded finished turn returns that turn (tokens, logprobs, versions, routing)
  without the engine. The first request that differs ends the replay; the rest runs live.

Agents use `generate(...)`, `add(...)`, `run_tool(...)`, `score()`, `reward`, `metrics`, `base_url` (the
OpenAI endpoint of this episode, `moe_rl.agents.endpoint`) and the prompt's `messages`, `tools`,
`answer`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from moe_rl.agents.chat import ChatFormat, ParsedTurn, ToolCall
from moe_rl.sample import Sample

if TYPE_CHECKING:
    import concurrent.futures

    from moe_rl.agents.config import EpisodeConfig

# (sample, env ids, response length at which the turn ends, sampling overrides) -> sample after the turn
TurnFn = Callable[[Sample, list[int], int, dict], Awaitable[Sample]]


class EpisodeLimit(Exception):
    """`generate` past `max_turns` or `max_context_tokens`: the episode ends truncated."""


@dataclasses.dataclass(frozen=True)
class Turn:
    """One model turn as the agent sees it."""

    text: str
    content: str
    tool_calls: list[ToolCall]
    token_ids: list[int]
    finish_reason: str
    """"stop" (end-of-turn token), "length" (turn budget), as the engine ended it."""
    prompt_tokens: int
    """Ids the turn's request held: its sequence before the turn plus the new environment ids (the
    OpenAI endpoint's `usage.prompt_tokens`; `len(token_ids)` is its `completion_tokens`)."""
    reasoning: str | None = None
    """The turn's reasoning (`reasoning_content`), None without one."""

    def message(self) -> dict:
        return ParsedTurn(self.text, self.content, self.tool_calls, 0, self.reasoning).message()


@dataclasses.dataclass(frozen=True)
class EpisodeSetting:
    """What every episode of a runner shares: the chat format, the limits, the default turn budget,
    the tool worker pool and the run's reward (a blocking call that never raises)."""

    chat: ChatFormat
    config: EpisodeConfig
    max_new_tokens: int
    tool_pool: concurrent.futures.Executor
    score: Callable[[str, Any, Sample], float]


class Episode:
    def __init__(
        self,
        *,
        group_id: str,
        index: int,
        messages: list[dict],
        tools: list[dict] | None,
        answer: Any,
        metadata: dict,
        setting: EpisodeSetting,
        turn: TurnFn,
        replay: list[dict] | None = None,
    ):
        self.group_id, self.index = group_id, index
        self.messages, self.tools = [dict(m) for m in messages], tools
        self.answer, self.metadata = answer, metadata
        self.chat, self.config, self._turn = setting.chat, setting.config, turn
        self.max_new_tokens, self.tool_pool, self._score = setting.max_new_tokens, setting.tool_pool, setting.score
        self.base_url = ""  # the endpoint's URL of this episode, set when its runner opens it
        self.reward: float | None = None
        self.metrics: dict[str, float] = {}
        """The agent's own figures for this episode (a skill shown, a count), by name: logged each
        step as `agents/metric/<name>`, the mean over the finished episodes that set it."""
        self.sequences: list[Sample] = []  # closed by a history rewrite
        self.current: Sample | None = None
        self.pending: list[int] = []  # environment ids not yet read by a turn
        self.history: list[dict] = []  # the conversation `current` holds (message mode)
        self.token_mode = False  # `add(token_ids=...)` was used: the agent works in tokens
        self.turn_ended = True
        self.turns = self.tool_calls = self.tool_errors = self.forks = self.replayed = 0
        self.calls: list[dict] = []  # every parsed tool call, {"turn", "name", "arguments"} (dumps)
        self.truncated = False
        self.last_text = ""  # the latest turn's text (a truncated episode is scored on it)
        self.engine_error: Exception | None = None  # a failed turn: the rollout's fault, not the agent's
        self.generate_s = 0.0
        self.log: list[dict] = []  # per finished turn: the sequence after it (run checkpoints)
        self._replay = list(replay or [])
        self._lock = asyncio.Lock()  # one turn at a time (the endpoint may get concurrent calls)

    # -- the agent's API -------------------------------------------------------------------------

    async def generate(
        self,
        messages: list[dict] | None = None,
        *,
        tools: list[dict] | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        stop_token_ids: list[int] | None = None,
    ) -> Turn:
        """One model turn. `messages`: the whole conversation so far (the endpoint's form); None:
        the episode's own `messages` (grown by `add` and by each turn's assistant message), or,
        after `add(token_ids=...)`, the record as it stands."""
        async with self._lock:
            return await self._generate(messages, tools, max_tokens, temperature, top_p, stop_token_ids)

    def add(self, messages: list[dict] | None = None, *, token_ids: list[int] | None = None) -> None:
        """Environment input for the next turn: chat messages (rendered with the template), or
        raw token ids (appended as they are; the agent then works in tokens)."""
        if (messages is None) == (token_ids is None):
            raise ValueError("Episode.add: give messages or token_ids")
        if messages is not None:
            if self.token_mode:
                raise ValueError("Episode.add(messages=...) after add(token_ids=...): use one form per episode")
            self.messages.extend(dict(m) for m in messages)
            return
        if self.current is None:
            raise ValueError("Episode.add(token_ids=...) before the first turn: the prompt comes from the task")
        if not all(isinstance(t, int) and 0 <= t < len(self.chat.tokenizer) for t in token_ids):
            raise ValueError(f"Episode.add: token_ids must be ids of the tokenizer (0..{len(self.chat.tokenizer) - 1})")
        self.token_mode = True
        self.pending.extend(token_ids)

    async def run_tool(self, fn: Callable, *args, **kwargs) -> Any:
        """Run blocking tool code in the tool worker pool, off the rollout loop; an exception
        counts a tool error and is raised to the agent."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self.tool_pool, functools.partial(fn, *args, **kwargs))
        except Exception:
            self.tool_errors += 1
            raise

    async def score(self) -> float:
        """The run's reward (`rollout.reward`, or the task's) of the last turn's text, off the loop
        through the run's `RewardScorer`: an error or a timeout scores 0, counted as every reward
        call is. The reward's `sample` is the current sequence, its metadata's `conversation` the
        messages the record holds (message mode)."""
        if self.current is None:
            raise ValueError("Episode.score before the first turn: there is nothing to score")
        sample = dataclasses.replace(self.current, metadata={**self.current.metadata, "conversation": self.history})
        return await asyncio.to_thread(self._score, self.last_text, self.answer, sample)

    # -- turns -----------------------------------------------------------------------------------

    async def _generate(self, messages, tools, max_tokens, temperature, top_p, stop_token_ids) -> Turn:
        if self.turns >= self.config.max_turns:
            self._end_truncated(f"max_turns={self.config.max_turns} reached")
        own = messages is None
        tools = tools if tools is not None else self.tools
        env, new_sequence = self._environment(self.messages if own else messages, tools)
        sample = self.current
        used = len(sample.prompt_ids) + len(sample.response_ids) + len(env)
        room = self.config.max_context_tokens - used
        if room <= 0:
            self._end_truncated(f"max_context_tokens={self.config.max_context_tokens} reached ({used} tokens)")
        budget = min(max_tokens or self.max_new_tokens, room)
        before = len(sample.response_ids) + len(env)
        sampling = {k: v for k, v in dict(temperature=temperature, top_p=top_p).items() if v is not None}
        if stop_token_ids:
            sampling["stop_token_ids"] = stop_token_ids
        start = time.perf_counter()
        try:
            after = self._replayed(sample, env) or await self._turn(sample, env, before + budget, sampling)
        except Exception as error:
            self.engine_error = error
            raise
        self.generate_s += time.perf_counter() - start
        self.current, self.pending = after, []
        ids = after.response_ids[before:]
        parsed = self.chat.parse(ids, tools)
        finish = "stop" if ids and ids[-1] in self._stops(stop_token_ids) else "length"
        turn = Turn(
            parsed.text,
            parsed.content,
            parsed.tool_calls,
            ids,
            finish,
            len(sample.prompt_ids) + before,
            parsed.reasoning,
        )
        self.last_text = parsed.text
        self.turns += 1
        self.tool_calls += len(parsed.tool_calls)
        self.calls += [{"turn": self.turns, "name": c.name, "arguments": c.arguments} for c in parsed.tool_calls]
        self.tool_errors += parsed.tool_errors
        self.turn_ended = finish == "stop"
        if not self.token_mode:
            conversation = self.messages if own else messages
            self.history = [*conversation, parsed.message()]
            if own:
                self.messages.append(parsed.message())
        self.log.append({"new_sequence": new_sequence, "sample": after.to_dict()})
        return turn

    def _environment(self, messages: list[dict], tools) -> tuple[list[int], bool]:
        """The ids this turn adds before generating; starts a sequence when there is none or the
        agent rewrote its history. Returns (ids, whether a new sequence started)."""
        if self.current is not None and self.token_mode:
            return list(self.pending), False
        if self.current is not None:
            ids = self.chat.extension_ids(self.history, messages, tools, self.turn_ended)
            if ids is not None:
                return list(self.pending) + ids, False
            self.sequences.append(self.current)
            self.forks += 1
        prompt = self.chat.prompt_ids(messages, tools)
        self.current = Sample(
            prompt_ids=prompt,
            group_id=self.group_id,
            metadata={**self.metadata, "answer": self.answer, "episode": self.index},
        )
        self.pending, self.turn_ended = [], True
        return [], True

    def _replayed(self, sample: Sample, env: list[int]) -> Sample | None:
        """The recorded sequence after this turn, when the request equals the recorded one."""
        if not self._replay:
            return None
        recorded = Sample.from_dict(self._replay[0]["sample"])
        request = sample.prompt_ids + sample.response_ids + env
        held = recorded.prompt_ids + recorded.response_ids
        if len(held) <= len(request) or held[: len(request)] != request:
            self._replay.clear()  # the agent took another path: generate from here on
            return None
        self._replay.pop(0)
        self.replayed += 1
        return recorded

    def _stops(self, extra) -> set[int]:
        return {self.chat.eos_id, *(extra or [])}

    def _end_truncated(self, why: str):
        self.truncated = True
        raise EpisodeLimit(why)

    # -- the result ------------------------------------------------------------------------------

    def samples(self) -> list[Sample]:
        """The episode's trainable sequences with its reward (status "truncated" after a limit)."""
        sequences = self.sequences + ([self.current] if self.current is not None else [])
        out = []
        for i, sample in enumerate(sequences):
            # a turn ended by its budget does not end the episode; a limit does
            status = "truncated" if self.truncated and i == len(sequences) - 1 else "completed"
            meta = {
                **sample.metadata,
                "turns": self.turns,
                "tool_calls": self.tool_calls,
                "calls": list(self.calls),
                "metrics": dict(self.metrics),
                "sequence": i,
                "sequences": len(sequences),
            }
            out.append(dataclasses.replace(sample, reward=self.reward, status=status, metadata=meta))
        return out

    def stats(self, wall_s: float) -> dict[str, float]:
        return {
            "turns": self.turns,
            "tool_calls": self.tool_calls,
            "tool_errors": self.tool_errors,
            "forks": self.forks,
            "replayed_turns": self.replayed,
            "generate_s": self.generate_s,
            "env_s": max(wall_s - self.generate_s, 0.0),
            "truncated": float(self.truncated),
        }
