"""`ChatEndpoint`: an OpenAI-compatible `/v1/chat/completions` per episode, on the rollout loop.

Each running episode gets a base URL `http://{host}:{port}/episodes/{token}/v1` with an
unguessable token (`secrets.token_urlsafe`), so an agent written against the OpenAI SDK runs
unchanged (`AsyncOpenAI(base_url=episode.base_url, api_key="-")`) and every call lands in its own
episode; unknown or finished episodes get 404. Loopback by default
(`rollout.episode.endpoint_host`).

`POST {base}/chat/completions` takes `messages`, `tools`, `tool_choice` ("auto", "none": calls
are left in the content, as SGLang leaves them; a template cannot force a call: "required" and
named functions are refused), `temperature`,
`top_p`, `max_tokens` / `max_completion_tokens`, `stop` (strings that are single tokens of the
tokenizer), `n` = 1, `stream`. Each call is one `Episode.generate` (token-in-token-out), and
the answer is OpenAI's schema: `choices[0].message` with `content` and `tool_calls`,
`finish_reason` ("tool_calls", "stop", "length"), `usage`. With `stream: true` (harness programs
such as verifiers' chat loop stream) the same answer comes as server-sent events once the turn is
generated: one `chat.completion.chunk` whose delta holds the whole message (tool calls with their
`index`), one with the finish reason, the usage chunk when `stream_options.include_usage`, then
`[DONE]`. A limit reached answers 400 with code `episode_limit` (the episode ends truncated).
Errors use OpenAI's `{"error": {...}}` body, before any event.

`usage` agrees with the episode record: `prompt_tokens` is the number of ids the turn's engine
request held (the sequence before the turn plus the environment ids this call adds; a call that
starts a new sequence: its rendered prompt), `completion_tokens` the ids sampled in the turn (the
record keeps them with loss mask 1), `total_tokens` their sum: the sequence's length after it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import socket
import time
import uuid

from aiohttp import web

from moe_rl.agents.chat import ChatFormat
from moe_rl.agents.episode import Episode, EpisodeLimit, Turn


class RequestError(ValueError):
    def __init__(self, status: int, message: str, code: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.code = status, code


class ChatEndpoint:
    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self.host, self.port = host, port
        self.episodes: dict[str, Episode] = {}
        self._tokens: dict[int, str] = {}  # id(episode) -> token
        self._runner: web.AppRunner | None = None
        self._started: asyncio.Event | None = None
        self.calls = 0

    async def start(self) -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/episodes/{token}/v1/chat/completions", self._chat)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        self._runner = runner
        self._ready().set()

    def _ready(self) -> asyncio.Event:
        if self._started is None:
            self._started = asyncio.Event()
        return self._started

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner, self._started = None, None

    @property
    def address(self) -> str:
        host = socket.gethostname() if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"

    async def open(self, episode: Episode) -> str:
        """Register a running episode (once the server listens); returns its base URL."""
        await self._ready().wait()
        token = secrets.token_urlsafe(24)
        self.episodes[token], self._tokens[id(episode)] = episode, token
        return f"{self.address}/episodes/{token}/v1"

    def close(self, episode: Episode) -> None:
        """The episode finished: its URL answers 404 from now on."""
        self.episodes.pop(self._tokens.pop(id(episode), ""), None)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        episode = self.episodes.get(request.match_info["token"])
        if episode is None:
            return _error(404, "no such episode (unknown, or finished)", "episode_not_found")
        try:
            body = await request.json()
            kwargs = self._arguments(body, episode)
            turn = await episode.generate(body["messages"], **kwargs)
        except RequestError as error:
            return _error(error.status, str(error), error.code)
        except EpisodeLimit as error:
            return _error(400, f"episode limit: {error}", "episode_limit")
        except ValueError as error:
            return _error(400, str(error))
        self.calls += 1
        message = completion_message(turn, episode.chat, body.get("tool_choice"))
        finish = "tool_calls" if message.get("tool_calls") else turn.finish_reason
        head = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "created": int(time.time()),
            "model": body.get("model") or "moe-rl-policy",
        }
        usage = {
            "prompt_tokens": turn.prompt_tokens,
            "completion_tokens": len(turn.token_ids),
            "total_tokens": turn.prompt_tokens + len(turn.token_ids),
        }
        if not body.get("stream"):
            choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
            return web.json_response({**head, "object": "chat.completion", "choices": [choice], "usage": usage})
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return await _stream(request, head, message, finish, usage if include_usage else None)

    def _arguments(self, body, episode: Episode) -> dict:
        """Episode.generate's keyword arguments from a request body (RequestError on bad input)."""
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list) or not body["messages"]:
            raise RequestError(400, "'messages' must be a non-empty list of chat messages")
        for i, message in enumerate(body["messages"]):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise RequestError(400, f"messages[{i}] must be an object with a 'role'")
        if body.get("n", 1) != 1:
            raise RequestError(400, "n must be 1: each call is one turn of the episode")
        options = body.get("stream_options")
        if options is not None and not (body.get("stream") and isinstance(options, dict)):
            raise RequestError(400, "stream_options needs stream=true and must be an object")
        choice = body.get("tool_choice")
        if choice not in (None, "auto", "none"):
            raise RequestError(400, f"tool_choice={choice!r}: supported are 'auto' and 'none'")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise RequestError(400, "'tools' must be a list of tool definitions")
        kwargs: dict = {"tools": tools or []}  # a call without tools renders none
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is not None:
            if not isinstance(max_tokens, int) or max_tokens < 1:
                raise RequestError(400, f"max_tokens={max_tokens!r}: must be an integer >= 1")
            kwargs["max_tokens"] = max_tokens
        for name in ("temperature", "top_p"):
            value = body.get(name)
            if value is not None:
                if not isinstance(value, (int, float)) or value < 0 or (name == "top_p" and not 0 < value <= 1):
                    raise RequestError(400, f"{name}={value!r} is out of range")
                kwargs[name] = float(value)
        stop = body.get("stop")
        if stop is not None:
            stops = [stop] if isinstance(stop, str) else stop
            ids = []
            for text in stops:
                encoded = episode.chat.encode(text) if isinstance(text, str) else []
                if len(encoded) != 1:
                    raise RequestError(
                        400, f"stop={text!r}: engines stop on token ids; give strings that are one token each"
                    )
                ids.append(encoded[0])
            kwargs["stop_token_ids"] = ids
        return kwargs


def completion_message(turn: Turn, chat: ChatFormat, tool_choice: str | None) -> dict:
    """The answer's `choices[0].message`. As SGLang's chat server: the reasoning is split off
    always, tool calls are parsed unless `tool_choice` is "none" (then they stay in the content)."""
    if tool_choice != "none":
        return turn.message()
    reasoning, content = chat.split_reasoning(turn.text)
    return dataclasses.replace(turn, content=content, tool_calls=[], reasoning=reasoning).message()


async def _stream(
    request: web.Request, head: dict, message: dict, finish: str, usage: dict | None
) -> web.StreamResponse:
    """The whole answer as OpenAI's chat-completion chunks (server-sent events)."""
    delta = dict(message)
    if "tool_calls" in delta:
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(delta["tool_calls"])]
    chunks = [
        {"choices": [{"index": 0, "delta": delta, "finish_reason": None, "logprobs": None}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": finish, "logprobs": None}]},
    ]
    if usage is not None:
        chunks.append({"choices": [], "usage": usage})
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    for chunk in chunks:
        event = {**head, "object": "chat.completion.chunk", **chunk}
        await response.write(f"data: {json.dumps(event)}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def _error(status: int, message: str, code: str = "invalid_request_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": code, "code": code}}, status=status)
