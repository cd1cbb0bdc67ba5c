"""Tool-call formats whose arguments are one JSON object: Qwen2.5/Qwen3 and Hermes `<tool_call>`
blocks, DeepSeek-V3 and V3.1 special-token blocks, Kimi-K2 sections.

Each parser follows SGLang 0.5.23's detector of the same name on a whole turn (`detect_and_parse`):
where the content ends, which blocks are read, and which failures drop every call of the turn
(SGLang's DeepSeek and Hermes detectors give the whole text back as content when any block fails).
"""

from __future__ import annotations

import json
import re

from moe_rl.agents.parsers.base import ToolCall, ToolParser, call_from_json, schema_properties


def _calls_in(value) -> tuple[list[ToolCall], int]:
    """The calls of one decoded block (an object, or a list of them) and how many were not calls
    (no name, arguments not an object). TypeError: an item is not an object, which fails SGLang's
    whole parse (the turn's text becomes the content)."""
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(item, dict) for item in items):
        raise TypeError(value)
    calls = [call for call in map(call_from_json, items) if call is not None]
    return calls, len(items) - len(calls)


class Qwen25(ToolParser):
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call. The
    newlines belong to the format (SGLang reads no block without them). Content: the text before
    the first block, stripped; text after the calls is dropped. A block that is not JSON is
    skipped; one whose JSON is not an object drops every call (the whole text is the content).
    Models: Qwen2.5, Qwen3 (-MoE), QwQ."""

    name = "qwen25"
    START = "<tool_call>\n"
    BLOCK = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)

    def parse(self, text, tools=None):
        begun, start = text.count("<tool_call>"), text.find(self.START)
        if start < 0:
            return text, [], begun
        calls, read, bad = [], 0, 0
        for body in self.BLOCK.findall(text):
            try:
                found, invalid = _calls_in(json.loads(body.strip()))
            except ValueError:
                continue
            except TypeError:
                return text, [], begun
            calls, read, bad = calls + found, read + 1, bad + invalid
        return text[:start].strip(), calls, begun - read + bad


class Hermes(ToolParser):
    """`<tool_call>{json}</tool_call>` with any whitespace inside the tags; a last block left open
    (the turn ended before `</tool_call>`) is read too. Content: the text before the first block,
    stripped. One block that is not JSON drops every call: the whole text is the content.
    Models: Hermes 2/3 and models trained on its format."""

    name = "hermes"
    BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)

    def parse(self, text, tools=None):
        start = text.find("<tool_call>")
        if start < 0:
            return text, [], 0
        calls, errors = [], 0
        for closed, open_ in self.BLOCK.findall(text):
            body = closed or open_
            if not body:
                continue
            try:
                found, bad = _calls_in(json.loads(body.strip()))
            except (ValueError, TypeError):
                return text, [], text.count("<tool_call>")
            calls += found
            errors += bad
        return text[:start].strip(), calls, errors


class DeepSeekV3(ToolParser):
    """`<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\\n```json\\n{args}\\n```
    <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`. Content: the text before the calls, stripped. One call
    whose layout or JSON is broken drops every call: the whole text is the content.
    Models: DeepSeek-V3, V3-0324, R1-0528."""

    name = "deepseekv3"
    START = "<｜tool▁calls▁begin｜>"
    CALL = re.compile(r"<｜tool▁call▁begin｜>.*?<｜tool▁call▁end｜>", re.DOTALL)
    DETAIL = re.compile(
        r"<｜tool▁call▁begin｜>(.*)<｜tool▁sep｜>(.*)\n```json\n(.*)\n```<｜tool▁call▁end｜>", re.DOTALL
    )
    NAME, ARGUMENTS = 2, 3

    def parse(self, text, tools=None):
        start = text.find(self.START)
        begun = text.count("<｜tool▁call▁begin｜>")
        if start < 0:
            return text, [], begun
        calls = []
        for block in self.CALL.findall(text):
            detail = self.DETAIL.search(block)
            try:
                if detail is None:
                    raise ValueError(block)
                call = call_from_json({"name": detail[self.NAME], "parameters": json.loads(detail[self.ARGUMENTS])})
            except ValueError:
                return text, [], begun
            calls += [call] if call is not None else []
        return text[:start].strip(), calls, begun - len(calls)


class DeepSeekV31(DeepSeekV3):
    """`<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{args}<｜tool▁call▁end｜>...`
    (the V3.1 template); the rest as `deepseekv3`. Models: DeepSeek-V3.1, V3.1-Terminus."""

    name = "deepseekv31"
    DETAIL = re.compile(r"<｜tool▁call▁begin｜>(.*)<｜tool▁sep｜>(.*)<｜tool▁call▁end｜>", re.DOTALL)
    NAME, ARGUMENTS = 1, 2


class KimiK2(ToolParser):
    """`<|tool_calls_section_begin|><|tool_call_begin|>functions.{name}:{n}<|tool_call_argument_begin|>
    {args}<|tool_call_end|>...<|tool_calls_section_end|>`. Content: the text before the section.
    A call id that is a bare counter takes its name from `tools` (the one tool, or the one whose
    properties best match the argument keys). The call keeps the id the model wrote, which Kimi's
    template renders back (SGLang numbers ids from the request's history instead); a call whose
    arguments are not a JSON object is an error (SGLang passes the text through).
    Models: Kimi-K2, K2-Instruct-0905, K2-Thinking."""

    name = "kimi_k2"
    START = "<|tool_calls_section_begin|>"
    CALL = re.compile(
        r"<\|tool_call_begin\|>\s*([^\s<|]+)\s*<\|tool_call_argument_begin\|>\s*(\{.*?\})\s*<\|tool_call_end\|>",
        re.DOTALL,
    )
    ID = re.compile(r"^(?:functions\.)?([\w.\-]+):(\d+)$")

    def parse(self, text, tools=None):
        begun = text.count("<|tool_call_begin|>")
        if self.START not in text:
            return text, [], begun
        calls = []
        for call_id, arguments in self.CALL.findall(text):
            name = self._name(call_id, arguments, tools)
            try:
                value = json.loads(arguments)
            except ValueError:
                continue
            if name is not None and isinstance(value, dict):
                calls.append(
                    ToolCall(name, value, call_id if self.ID.match(call_id) else f"functions.{name}:{call_id}")
                )
        return text[: text.find(self.START)], calls, begun - len(calls)

    def _name(self, call_id: str, arguments: str, tools: list[dict] | None) -> str | None:
        standard = self.ID.match(call_id)
        if standard:
            return standard[1]
        if not call_id.isdigit() or not tools:
            return None
        functions = [tool.get("function", tool) for tool in tools]
        if len(functions) == 1:
            return functions[0].get("name")
        try:
            keys = set(json.loads(arguments))
        except (ValueError, TypeError):
            return None
        best, best_score = None, -1
        for function in functions:
            declared = set(schema_properties(function.get("parameters") or {}))
            score = len(keys & declared) - len(keys - declared)
            if declared and score > best_score:
                best, best_score = function.get("name"), score
        return best
