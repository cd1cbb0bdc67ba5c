"""`lookup`: the multi-turn tool task the CPU agent demo learns (`make demo-agent`).

The prompt names a key ("key C"); the model must call the `lookup` tool with it, read the value
the tool returns (a digit, drawn per prompt, so it cannot be memorised) and answer with that
value. The task is written twice, as a plain agent function (`lookup_agent`) and as an
OpenAI-SDK agent against the episode's endpoint (`lookup_openai_agent`); both score the same
(`score`):
- `CALL_CREDIT` for a `lookup` call, unless the answering turn calls again (both turns open
  the same way, so a model that has just learned to call would call there too: the task is to
  call once, then answer);
- `KEY_CREDIT` when the call names the prompt's key;
- `ANSWER_CREDIT` when the final answer's first character is the value.
Each episode also records which skills it showed (`episode.metrics`: `called`, `right_key`,
`right_answer`), logged per step as `agents/metric/<name>`.
The partial credit gives a random-init model a signal at each step of the skill (the tiny
tokenizer holds each whole call as one token: `moe_rl.agents.tiny_tokenizer`). The tool sleeps
`latency_s` (a task option) in the tool worker pool, to model tools that take real time.
"""

from __future__ import annotations

import json
import random
import time
from typing import Any, Iterator

from moe_rl.agents.episode import Episode
from moe_rl.agents.tiny_tokenizer import KEYS
from moe_rl.sample import Sample
from moe_rl.tasks.registry import Prompt, Task, register_task

CALL_CREDIT, KEY_CREDIT, ANSWER_CREDIT = 0.2, 0.3, 0.5
LOOKUP_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "The value stored under a key.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
    },
}


def lookup(table: dict[str, str], key: Any, latency_s: float = 0.0) -> str:
    """The tool: blocking code (it sleeps `latency_s`), run in the tool worker pool."""
    time.sleep(latency_s)
    return table.get(key, "unknown key") if isinstance(key, str) else "key must be a string"


@register_task("lookup")
class LookupTask(Task):
    def __init__(self, num_keys: int = len(KEYS), latency_s: float = 0.0):
        if not 1 <= num_keys <= len(KEYS):
            raise ValueError(f"lookup task num_keys={num_keys}: use 1..{len(KEYS)}")
        if latency_s < 0:
            raise ValueError(f"lookup task latency_s={latency_s}: must be >= 0")
        self.keys, self.latency_s = KEYS[:num_keys], latency_s

    def prompts(self, seed: int) -> Iterator[Prompt]:
        rng = random.Random(seed)
        while True:
            table = {key: str(rng.randrange(10)) for key in self.keys}
            key = rng.choice(self.keys)
            yield Prompt(
                messages=[{"role": "user", "content": f"key {key}"}],
                tools=[LOOKUP_TOOL],
                answer=table[key],
                metadata={"key": key, "table": table, "latency_s": self.latency_s},
            )

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError("lookup is an agent task: set rollout.agent (moe_rl.tasks.lookup:lookup_agent)")

    def reward(self, response: str, answer: Any, sample: Sample) -> float:
        """A truncated episode's score: the answer credit on its last turn."""
        return ANSWER_CREDIT * answered(response, answer)


def answered(text: str, answer: str) -> bool:
    return text.strip()[:1] == answer


def score(episode: Episode, right_key: bool, called_again: bool, final_content: str) -> float:
    """An episode that called `lookup`: the call credit unless the answering turn called again,
    the key credit, the answer credit; the skills go to `episode.metrics`."""
    right_answer = answered(final_content, episode.answer)
    episode.metrics.update(called=True, right_key=right_key, right_answer=right_answer)
    return CALL_CREDIT * (not called_again) + KEY_CREDIT * right_key + ANSWER_CREDIT * right_answer


def no_call(episode: Episode, content: str) -> float:
    """An episode that answered without calling `lookup`: the answer credit (a lucky guess)."""
    right_answer = answered(content, episode.answer)
    episode.metrics.update(called=False, right_key=False, right_answer=right_answer)
    return ANSWER_CREDIT * right_answer


async def lookup_agent(episode: Episode) -> float:
    """The plain agent: one turn, at most one lookup, one answering turn."""
    task = episode.metadata["prompt"]
    turn = await episode.generate(max_tokens=2)
    calls = [call for call in turn.tool_calls if call.name == "lookup"]
    if not calls:
        return no_call(episode, turn.content)
    key = calls[0].arguments.get("key")
    value = await episode.run_tool(lookup, task["table"], key, task["latency_s"])
    episode.add([{"role": "tool", "tool_call_id": calls[0].id, "content": value}])
    final = await episode.generate(max_tokens=2)
    return score(episode, key == task["key"], bool(final.tool_calls), final.content)


async def lookup_openai_agent(episode: Episode) -> float:
    """The same agent, written against the OpenAI SDK (it knows only its base URL)."""
    from openai import AsyncOpenAI  # optional: the `agents` extra

    task = episode.metadata["prompt"]
    client = AsyncOpenAI(base_url=episode.base_url, api_key="moe-rl", max_retries=0)
    try:
        messages = list(episode.messages)
        reply = await client.chat.completions.create(
            model="policy", messages=messages, tools=episode.tools, max_tokens=2
        )
        message = reply.choices[0].message
        calls = [call for call in message.tool_calls or [] if call.function.name == "lookup"]
        if not calls:
            return no_call(episode, message.content or "")
        key = json.loads(calls[0].function.arguments).get("key")
        value = await episode.run_tool(lookup, task["table"], key, task["latency_s"])
        messages += [
            message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": calls[0].id, "content": value},
        ]
        final = await client.chat.completions.create(
            model="policy", messages=messages, tools=episode.tools, max_tokens=2
        )
        last = final.choices[0].message
    finally:
        await client.close()
    return score(episode, key == task["key"], bool(last.tool_calls), last.content or "")
