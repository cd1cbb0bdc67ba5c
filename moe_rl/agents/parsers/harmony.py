"""gpt-oss's harmony format: the reasoning parser and the tool-call parser "gpt-oss".

A turn is a run of messages, each `[<|start|>assistant]<|channel|>{header}<|message|>{body}`
ended by `<|end|>`, `<|call|>` or (the final channel only) `<|return|>` or the end of the text.
As SGLang 0.5.23's HarmonyParser reads them:
- analysis ended by `<|end|>`: reasoning; a turn cut inside analysis keeps what it holds;
- commentary (or analysis, built-in tools) ended by `<|call|>`: a tool call, its header
  `to=functions.NAME <|constrain|>json`, its body the JSON arguments;
- commentary ended by `<|end|>` (a preamble) and final: content;
- any other block cut by the turn's budget is dropped, as is a marker cut in half at the end.
The reasoning parser keeps a call's raw text in the content, for the tool parser after it.
Unlike SGLang, a turn without any harmony marker is content as it stands (SGLang falls back to
reading `analysis`/`assistantfinal` words, or drops it).
"""

from __future__ import annotations

import dataclasses
import json
import re

from moe_rl.agents.parsers.base import ReasoningParser, ToolCall, ToolParser

MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>")
_MARKER = re.compile("|".join(map(re.escape, MARKERS)))
_CALL = re.compile(r"to=([a-zA-Z_][a-zA-Z0-9_.-]*)\s*<\|constrain\|>json<\|message\|>(.*?)(?:<\|call\|>|$)", re.DOTALL)
_RECIPIENT = re.compile(r"<\|(?:start|channel)\|>[^<]*\bto=")
_ENDS = {  # the markers that end a message, by channel (None: a message without a channel)
    "analysis": ("<|end|>", "<|call|>"),
    "commentary": ("<|end|>", "<|call|>"),
    "final": ("<|return|>",),
    None: ("<|end|>", "<|call|>", "<|return|>"),
}


@dataclasses.dataclass(frozen=True)
class Event:
    kind: str
    """"reasoning", "content" or "call"."""
    text: str
    """The body; for a call, the whole block with its markers."""


@dataclasses.dataclass(frozen=True)
class _Token:
    marker: str | None  # None: text
    start: int
    end: int


def _tokens(text: str) -> list[_Token]:
    tokens, pos = [], 0
    for match in _MARKER.finditer(text):
        if match.start() > pos:
            tokens.append(_Token(None, pos, match.start()))
        tokens.append(_Token(match.group(), match.start(), match.end()))
        pos = match.end()
    if pos < len(text):
        tokens.append(_Token(None, pos, len(text)))
    return tokens


def events(text: str) -> list[Event]:
    """The messages of a harmony turn, in order (see the module docstring)."""
    tokens, found, pos = _tokens(text), [], 0
    while pos < len(tokens):
        token = tokens[pos]
        if token.marker is None:
            body = text[token.start : token.end]
            after_call = pos > 0 and tokens[pos - 1].marker == "<|call|>"
            if pos == len(tokens) - 1:
                body = body[: len(body) - _partial_marker(body)]
                if body:
                    found.append(Event("content", body))
            elif not (after_call and body.strip().lower() == "commentary"):  # filler between calls
                found.append(Event("content", body))
            pos += 1
        elif token.marker in ("<|start|>", "<|channel|>"):
            block = _block(text, tokens, pos)
            if block is None:  # cut by the budget: only analysis keeps what it holds
                partial = _header(text, tokens, pos)
                if partial is not None and partial[0] == "analysis":
                    found.append(Event("reasoning", text[tokens[partial[1]].end :]))
                break
            event, pos = block
            found.append(event)
        else:
            pos += 1  # a stray marker
    return _without_commentary_filler(found, text.rstrip().endswith("<|call|>"))


def _header(text: str, tokens: list[_Token], pos: int) -> tuple[str | None, int] | None:
    """(channel, index of `<|message|>`) of the block at `pos`; channel None when the block has
    no `<|channel|>`; None when it has no `<|message|>` yet."""
    channel = None
    for i in range(pos + (tokens[pos].marker == "<|start|>"), len(tokens)):
        if tokens[i].marker == "<|channel|>" and channel is None:
            channel = i
        elif tokens[i].marker == "<|message|>":
            if channel is None:
                return None, i
            header = text[tokens[channel].end : tokens[i].start].strip().lower()
            kind = next((k for k in ("analysis", "commentary", "final") if header.startswith(k)), "unknown")
            return kind, i
    return None


def _block(text: str, tokens: list[_Token], pos: int) -> tuple[Event, int] | None:
    """The event of the block at `pos` and the index after it; None when it is not complete."""
    header = _header(text, tokens, pos)
    if header is None or header[0] == "unknown":
        return None
    kind, message = header
    ends = _ENDS[kind]
    end = next((i for i in range(message + 1, len(tokens)) if tokens[i].marker in ends), None)
    body_start = tokens[message].end
    if end is None:
        return (Event("content", text[body_start:]), len(tokens)) if kind == "final" else None
    body = text[body_start : tokens[end].start]
    if kind in ("analysis", "commentary") and tokens[end].marker == "<|call|>":
        return Event("call", text[tokens[pos].start : tokens[end].end]), end + 1
    if kind == "analysis":
        return Event("reasoning", body), end + 1
    if kind == "final" and end + 1 < len(tokens) and tokens[end + 1].marker is None:
        return Event("content", body + text[tokens[end + 1].start : tokens[end + 1].end]), end + 2
    return Event("content", body), end + 1


def _partial_marker(text: str) -> int:
    """Length of the longest end of `text` that begins a marker (a marker cut in half)."""
    return max((k for m in MARKERS for k in range(1, min(len(m), len(text) + 1)) if m.startswith(text[-k:])), default=0)


def _without_commentary_filler(found: list[Event], ends_with_call: bool) -> list[Event]:
    """SGLang drops content that spells (part of) "commentary", or only whitespace, right after a
    call (after any message when the turn ends with `<|call|>`)."""
    kept, filtering, partial = [], False, ""
    for event in found:
        if event.kind == "content" and (filtering or partial):
            word = partial + event.text.strip().lower()
            if "commentary".startswith(word):
                partial, filtering = ("" if word == "commentary" else word), word != "commentary"
                continue
            partial, filtering = "", False
        kept.append(event)
        filtering = filtering or event.kind == "call" or ends_with_call
        partial = "" if event.kind == "call" else partial
    return kept


def _has_markers(text: str) -> bool:
    return "<|channel|>" in text or "<|start|>" in text


class GptOssReasoning(ReasoningParser):
    """Analysis messages are the reasoning; the rest (content, raw call blocks) is the content.
    Models: gpt-oss-20b, gpt-oss-120b."""

    name = "gpt-oss"

    def split(self, text):
        if not _has_markers(text):
            return None, text
        found = events(text)
        reasoning = "".join(e.text for e in found if e.kind == "reasoning")
        return reasoning or None, "".join(e.text for e in found if e.kind != "reasoning")


class GptOss(ToolParser):
    """Calls in commentary messages to `functions.NAME` with `<|constrain|>json`; content: the
    content messages joined by a space, stripped. As in SGLang, a turn is read for calls only when
    it holds `<|start|>assistant<|channel|>commentary` (a call that opens the turn, right after
    the prompt's `<|start|>assistant`, is not read); a call whose arguments are not JSON is
    dropped."""

    name = "gpt-oss"

    def parse(self, text, tools=None):
        begun = len(_RECIPIENT.findall(text))
        if "<|start|>assistant<|channel|>commentary" not in text:
            return text, [], begun
        calls, content = [], []
        for event in events(text):
            if event.kind == "content":
                content.append(event.text)
            elif event.kind == "call" and (call := _call(event.text)) is not None:
                calls.append(call)
        return " ".join(content).strip(), calls, begun - len(calls)


def _call(block: str) -> ToolCall | None:
    match = _CALL.search(block)
    if match is None:
        return None
    try:
        arguments = json.loads(match[2]) if match[2].strip() else {}
    except ValueError:
        return None
    return ToolCall(match[1].split(".")[-1], arguments) if isinstance(arguments, dict) else None
