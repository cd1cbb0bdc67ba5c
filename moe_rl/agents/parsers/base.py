"""The parser interfaces and what they produce: `ToolCall`, `ToolParser`, `ReasoningParser`.

A tool parser reads the text of one sampled turn (reasoning already split off) and returns
`(content, calls, errors)`: the content SGLang's detector of the same name leaves, the calls it
parses (name and arguments, a JSON object), and how many calls the model began that did not become
a `ToolCall` (malformed, cut by the turn's budget, or not an object). `tools` (the request's
OpenAI function list) gives argument types to the formats that write values as bare text
(qwen3_coder, glm45) and a name to Kimi-K2's bare-counter calls; it never filters: a call to a
function the request did not declare is returned (SGLang drops it) and the agent answers it.

A reasoning parser splits a turn into `(reasoning, content)`; reasoning is None when the turn has
none (or an empty block), as SGLang reports it.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import uuid
from typing import Any, ClassVar


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]
    id: str = dataclasses.field(default_factory=lambda: f"call_{uuid.uuid4().hex[:16]}")

    def openai(self) -> dict:
        """OpenAI's `tool_calls[]` entry (arguments as a JSON string)."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)},
        }


class ToolParser(abc.ABC):
    """A tool-call format (SGLang's `--tool-call-parser` name in `name`)."""

    name: ClassVar[str]

    @abc.abstractmethod
    def parse(self, text: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCall], int]:
        """(content, calls, errors) of one turn's text (see the module docstring)."""


class ReasoningParser(abc.ABC):
    """A reasoning format (SGLang's `--reasoning-parser` name in `name`)."""

    name: ClassVar[str]

    @abc.abstractmethod
    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None, content) of one turn's text."""


def call_from_json(value: Any) -> ToolCall | None:
    """A call from a decoded `{"name": ..., "arguments": {...}}` object ("parameters" is read as
    "arguments", as SGLang does); None when it has no name or its arguments are not an object."""
    if not isinstance(value, dict):
        return None
    name, arguments = value.get("name"), value.get("parameters") or value.get("arguments", {})
    if not name or not isinstance(name, str) or not isinstance(arguments, dict):
        return None
    return ToolCall(name, arguments)


def declared_parameters(tools: list[dict] | None, name: str) -> dict | None:
    """The parameters schema of function `name` in an OpenAI tools list ({} when it has none);
    None when the list does not declare the function."""
    for tool in tools or []:
        function = tool.get("function", tool)
        if function.get("name") == name:
            parameters = function.get("parameters")
            return parameters if isinstance(parameters, dict) else {}
    return None


def schema_properties(schema: Any) -> dict[str, Any]:
    """A parameters schema's `properties`, merged from anyOf/oneOf/allOf branches when the top
    level declares none."""
    if not isinstance(schema, dict):
        return {}
    if isinstance(schema.get("properties"), dict):
        return schema["properties"]
    merged: dict[str, Any] = {}
    for keyword in ("anyOf", "oneOf", "allOf"):
        for branch in schema.get(keyword) or []:
            for key, value in schema_properties(branch).items():
                merged.setdefault(key, value)
    return merged


def value_type(schema: Any) -> str | None:
    """The primary JSON type a parameter schema declares: its `type` (the first non-null one of a
    list), the common type of anyOf/oneOf branches (string when they disagree), the type of its
    enum values, the first non-string allOf type, object for `properties`, array for `items`."""
    if not isinstance(schema, dict):
        return None
    if "type" in schema:
        declared = schema["type"]
        if isinstance(declared, str):
            return declared
        if isinstance(declared, list) and declared:
            return next((t for t in declared if t != "null"), "string")
    branches = schema.get("anyOf") or schema.get("oneOf")
    if "anyOf" in schema or "oneOf" in schema:
        types = [t for t in (value_type(b) for b in branches or []) if t] if isinstance(branches, list) else []
        if types:
            distinct = set(types)
            if len(distinct) == 1:
                return types[0]
            if len(distinct) == 2 and "null" in distinct:
                return next(t for t in types if t != "null")
            return "string" if "string" in distinct else types[0]
    if isinstance(schema.get("enum"), list):
        kinds = {_json_kind(v) for v in schema["enum"]}
        return kinds.pop() if len(kinds) == 1 else "string"
    if isinstance(schema.get("allOf"), list):
        return next((t for t in map(value_type, schema["allOf"]) if t and t != "string"), "string")
    if "properties" in schema:
        return "object"
    if "items" in schema:
        return "array"
    return None


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    for kind, types in (("boolean", bool), ("integer", int), ("number", float), ("string", str)):
        if isinstance(value, types):
            return kind
    return "array" if isinstance(value, list) else "object"
