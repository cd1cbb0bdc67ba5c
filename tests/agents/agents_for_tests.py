"""Agent functions the episode tests run (named `tests.agents.agents_for_tests:NAME`)."""

from __future__ import annotations

import asyncio
import json

from moe_rl.agents import Episode

TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}


async def three_turns(episode: Episode) -> float:
    """Three model turns with a tool result and a user turn between them (plain agent API)."""
    await episode.generate(max_tokens=4)
    episode.add([{"role": "tool", "content": "value 7"}])
    await episode.generate(max_tokens=4)
    episode.add([{"role": "user", "content": "and now?"}])
    last = await episode.generate(max_tokens=4)
    episode.metrics["first"] = episode.index == 0
    return float(len(last.token_ids) + episode.index)  # rewards that differ within a group


async def in_tokens(episode: Episode) -> float:
    """Two turns joined by raw environment token ids."""
    await episode.generate(max_tokens=3)
    episode.add(token_ids=[40, 41, 42])
    await episode.generate(max_tokens=3)
    return float(episode.index)


async def until_limit(episode: Episode) -> float:
    """Turns forever: a limit ends it."""
    while True:
        await episode.generate(max_tokens=8)
        episode.add([{"role": "user", "content": "go on"}])


async def long_turns(episode: Episode) -> float:
    """Two long turns (a weight swap cuts them)."""
    await episode.generate(max_tokens=48)
    episode.add([{"role": "tool", "content": "ok"}])
    await episode.generate(max_tokens=48)
    return float(episode.index)


async def fails_by_group(episode: Episode) -> float:
    """Group g0-0 raises, g0-1 hangs, g0-2 returns garbage, later groups behave."""
    group = int(episode.group_id.rsplit("-", 1)[1])
    await episode.generate(max_tokens=2)
    if group == 0:
        raise RuntimeError("the tool server is down")
    if group == 1:
        await asyncio.sleep(3600)
    if group == 2:
        return "not a reward"
    return float(episode.index)


async def with_metrics(episode: Episode) -> float:
    """Sets its own metrics: group g0-0 a NaN (its group is dropped), the others the episode's index
    and whether it is the first of its group."""
    await episode.generate(max_tokens=2)
    first = episode.index == 0
    episode.metrics.update(index=float("nan") if episode.group_id.endswith("-0") else episode.index, first=first)
    return float(episode.index)


async def always_raises(episode: Episode) -> float:
    raise RuntimeError("broken agent")


async def openai_tools(episode: Episode) -> float:
    """An OpenAI-SDK agent: three calls, answering each tool call with a tool message and a
    plain reply with a user message; rewards from the episode index."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=episode.base_url, api_key="-", max_retries=0)
    messages = list(episode.messages)
    try:
        for _ in range(3):
            reply = await client.chat.completions.create(
                model="policy", messages=messages, tools=[TOOL], max_tokens=2, temperature=1.0
            )
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if message.tool_calls:
                messages += [{"role": "tool", "tool_call_id": c.id, "content": "7"} for c in message.tool_calls]
            else:
                messages.append({"role": "user", "content": "again"})
    finally:
        await client.close()
    episode.metadata["finish_reasons"] = [reply.choices[0].finish_reason]
    return float(episode.index)


CONVERSATIONS: dict[tuple[str, int], list[dict]] = {}


async def openai_three_calls(episode: Episode) -> float:
    """Three calls through the OpenAI SDK with the lookup tool offered: the first reply is answered
    by a tool result, the second by a user follow-up; the conversation lands in CONVERSATIONS."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=episode.base_url, api_key="-", max_retries=0)
    messages = list(episode.messages)
    try:
        for follow in (
            {"role": "tool", "tool_call_id": "call_1", "content": "7"},
            {"role": "user", "content": "and now?"},
            None,
        ):
            reply = await client.chat.completions.create(model="p", messages=messages, tools=[TOOL], max_tokens=4)
            messages.append(reply.choices[0].message.model_dump(exclude_none=True))
            if follow is not None:
                messages.append(follow)
    finally:
        await client.close()
    CONVERSATIONS[episode.group_id, episode.index] = messages
    return float(episode.index)


async def openai_rewrites_history(episode: Episode) -> float:
    """An OpenAI-SDK agent that rewrites its first message before the second call (a fork)."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=episode.base_url, api_key="-", max_retries=0)
    try:
        first = await client.chat.completions.create(model="p", messages=episode.messages, max_tokens=2)
        edited = [
            {"role": "user", "content": "a shorter prompt"},
            first.choices[0].message.model_dump(exclude_none=True),
        ]
        edited.append({"role": "user", "content": "next"})
        await client.chat.completions.create(model="p", messages=edited, max_tokens=2)
    finally:
        await client.close()
    return float(episode.index)


FINISHED_URLS: list[str] = []
PROBES: dict[str, int] = {}


async def probes_the_endpoint(episode: Episode) -> float:
    """Episode 0 makes one call and ends; episode 1 then probes: episode 0's URL (finished), an
    unknown token, and bad requests on its own URL; then makes one good call."""
    import aiohttp

    if episode.index == 0:
        await episode.generate(max_tokens=2)
        FINISHED_URLS.append(episode.base_url)
        return 0.0
    while not FINISHED_URLS:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)  # episode 0's function has returned: its runner closes its URL
    body = {"model": "p", "messages": episode.messages, "max_tokens": 2}
    unknown = episode.base_url.rsplit("/episodes/", 1)[0] + "/episodes/not-a-token/v1"
    async with aiohttp.ClientSession() as session:
        for name, url, extra in [
            ("finished", FINISHED_URLS[-1], {}),
            ("unknown", unknown, {}),
            ("n2", episode.base_url, {"n": 2}),
            ("stream", episode.base_url, {"stream": True}),
            ("required", episode.base_url, {"tool_choice": "required"}),
            ("stop", episode.base_url, {"stop": ["two tokens"]}),
            ("good", episode.base_url, {"stop": ["k"]}),
        ]:
            async with session.post(f"{url}/chat/completions", json={**body, **extra}) as response:
                PROBES[name] = response.status
    return 1.0


USAGE: dict[tuple[str, int], list[tuple[int, int, int]]] = {}
"""(group id, episode index) -> each call's usage (prompt, completion, total tokens)."""


async def openai_usage(episode: Episode) -> float:
    """An OpenAI-SDK agent of three calls (tool results or user turns between them) that keeps each
    answer's `usage`."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=episode.base_url, api_key="-", max_retries=0)
    messages, usage = list(episode.messages), USAGE.setdefault((episode.group_id, episode.index), [])
    try:
        for max_tokens in (3, 1, 2):
            reply = await client.chat.completions.create(
                model="p", messages=messages, tools=[TOOL], max_tokens=max_tokens
            )
            usage.append((reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens))
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if message.tool_calls:
                messages += [{"role": "tool", "tool_call_id": c.id, "content": "7"} for c in message.tool_calls]
            else:
                messages.append({"role": "user", "content": "again"})
    finally:
        await client.close()
    return float(episode.index)


STREAMED: dict[tuple[str, int], list[tuple]] = {}
"""(group id, episode index) -> each call's (stream?, content, tool calls, finish reason, usage)."""


async def openai_streams(episode: Episode) -> float:
    """An OpenAI-SDK agent whose first call streams (usage included) and whose second does not,
    after the first call's tool results; keeps what each answer said."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=episode.base_url, api_key="-", max_retries=0)
    messages, seen = list(episode.messages), STREAMED.setdefault((episode.group_id, episode.index), [])
    try:
        chunks = await client.chat.completions.create(
            model="p",
            messages=messages,
            tools=[TOOL],
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
        )
        content, calls, finish, usage = "", {}, None, None
        async for chunk in chunks:
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for call in choice.delta.tool_calls or []:
                    calls[call.index] = (call.id, call.function.name, call.function.arguments)
                finish = choice.finish_reason or finish
            usage = chunk.usage or usage
        tool_calls = [calls[i] for i in sorted(calls)]
        seen.append(
            (True, content, [c[1:] for c in tool_calls], finish, (usage.prompt_tokens, usage.completion_tokens))
        )
        messages.append(
            {
                "role": "assistant",
                "content": content,
                "tool_calls": [
                    {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in tool_calls
                ],
            }
        )
        messages += [{"role": "tool", "tool_call_id": i, "content": "7"} for i, _, _ in tool_calls]
        reply = await client.chat.completions.create(model="p", messages=messages, tools=[TOOL], max_tokens=2)
        message = reply.choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
        usage = (reply.usage.prompt_tokens, reply.usage.completion_tokens)
        seen.append((False, message.content, calls, reply.choices[0].finish_reason, usage))
    finally:
        await client.close()
    return 1.0


async def openai_lookup_from_metadata(episode: Episode) -> float:
    """A dataset-driven OpenAI-SDK agent: a call with the row's tools, answered by a tool result from
    the row's `metadata.table` (the model's call when it made one, else the table's first entry),
    then the answering call; reward 1 when the answer holds the row's value."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=episode.base_url, api_key="-", max_retries=0)
    table = episode.metadata["prompt"]["table"]
    messages = list(episode.messages)
    try:
        reply = await client.chat.completions.create(model="p", messages=messages, tools=episode.tools)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        calls = message.tool_calls or []
        key = json.loads(calls[0].function.arguments).get("key") if calls else next(iter(table))
        messages.append(
            {"role": "tool", "tool_call_id": calls[0].id if calls else "none", "content": table.get(key, "no such key")}
        )
        reply = await client.chat.completions.create(model="p", messages=messages, tools=episode.tools)
    finally:
        await client.close()
    return float(str(episode.answer) in (reply.choices[0].message.content or ""))
