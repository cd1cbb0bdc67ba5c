"""Tool-call formats that write each argument as its own tagged value: Qwen3-Coder's
`<function=...><parameter=...>` and GLM-4.5's `<arg_key>/<arg_value>` pairs.

A value is bare text, so its JSON type comes from the function's schema in the request's `tools`,
converted the way SGLang 0.5.23's detectors convert it (an integer parameter "3" becomes 3; an
undeclared one stays text in qwen3_coder and is read as JSON when it parses in glm45).
"""

from __future__ import annotations

import ast
import json
import re
import threading
import warnings
from typing import Any

from moe_rl.agents.parsers.base import (
    ToolCall,
    ToolParser,
    call_from_json,
    declared_parameters,
    schema_properties,
    value_type,
)

_LITERAL_LOCK = threading.Lock()  # catch_warnings changes process-wide filters


def _literal(text: str) -> Any:
    """`ast.literal_eval` without its invalid-escape warnings (the value keeps its backslashes)."""
    with _LITERAL_LOCK, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ast.literal_eval(text)


_LITERAL_ERRORS = (ValueError, SyntaxError, TypeError, MemoryError, RecursionError)


class Qwen3Coder(ToolParser):
    """`<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n
    </tool_call>`. A parameter ends at `</parameter>`, the next `<parameter=`, `</function>` or the
    end of the text, so a call cut by the turn's budget still gives what it holds, but only when
    the turn has no complete `<tool_call>` block. Content: the text before the first
    `<tool_call>`, unstripped. Models: Qwen3-Coder-480B-A35B, Qwen3-Coder-30B-A3B."""

    name = "qwen3_coder"
    BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    FUNCTION = re.compile(r"<function=(.*?)</function>|<function=(.*)$", re.DOTALL)
    PARAMETER = re.compile(r"<parameter=(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)", re.DOTALL)
    TEXT_TYPES = ("string", "str", "text", "varchar", "char", "enum")

    def parse(self, text, tools=None):
        begun = text.count("<function=")
        if "<tool_call>" not in text:
            return text, [], begun
        blocks = self.BLOCK.findall(text) or [text]
        calls = []
        for block in blocks:
            for closed, open_ in self.FUNCTION.findall(block):
                body = closed or open_
                if ">" not in body:
                    continue
                name, parameters = body.split(">", 1)
                schema = self._schema(tools, name)
                arguments = {}
                for match in self.PARAMETER.findall(parameters):
                    if ">" not in match:
                        continue
                    key, value = match.split(">", 1)
                    value = value[1:] if value.startswith("\n") else value
                    value = value[:-1] if value.endswith("\n") else value
                    arguments[key] = self._convert(value, schema, key)
                calls.append(ToolCall(name, arguments))
        start = text.find("<tool_call>")
        return text[:start], calls, begun - len(calls)

    @staticmethod
    def _schema(tools: list[dict] | None, name: str) -> dict:
        """The parameter schemas SGLang types values by: the function's properties, or its whole
        parameters object when it declares none."""
        parameters = declared_parameters(tools, name) or {}
        declared = schema_properties(parameters)
        return declared if declared or "properties" in parameters else parameters

    def _convert(self, value: str, schema: dict, key: str) -> Any:
        """Parameter `key`'s text as its schema's type ("null" is None for any parameter)."""
        if value.lower() == "null":
            return None
        if key not in schema:
            return value
        kind = str(value_type(schema[key]) or "string").strip().lower()
        if kind in self.TEXT_TYPES:
            return value
        if kind.startswith(("int", "uint", "long", "short", "unsigned")):
            try:
                return int(value)
            except ValueError:
                return value
        if kind.startswith(("num", "float")):
            try:
                number = float(value)
            except ValueError:
                return value
            keep_float = "." in value or "e" in value.lower()
            return int(number) if not keep_float and number.is_integer() else number
        if kind in ("boolean", "bool", "binary"):
            return value.lower() == "true"
        if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
            try:
                return json.loads(value)
            except ValueError:
                pass
        try:
            return _literal(value)
        except _LITERAL_ERRORS:
            return value


class Glm45(ToolParser):
    """`<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n...</tool_call>`
    (a literal `\\n` also separates). Values are read as JSON when they parse (numbers coerced for
    a "number" parameter); a "string" parameter keeps its text. Content: the text before the first
    `<tool_call>`, stripped; a block cut before `</tool_call>` gives no call. Models: GLM-4.5, GLM-4.5-Air, GLM-4.6."""

    name = "glm45"
    CALL = re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL)
    DETAIL = re.compile(r"<tool_call>(.*?)(?:\\n|\n)(.*)</tool_call>", re.DOTALL)
    ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>(?:\\n|\s)*<arg_value>(.*?)</arg_value>", re.DOTALL)

    def parse(self, text, tools=None):
        start = text.find("<tool_call>")
        if start < 0:
            return text, [], 0
        calls = []
        for block in self.CALL.findall(text):
            detail = self.DETAIL.search(block)
            if detail is None:
                continue
            name = detail[1]
            declared = schema_properties(declared_parameters(tools, name) or {})
            arguments = {}
            for key, value in self.ARGUMENT.findall(detail[2]):
                key = key.strip()
                arguments[key] = _glm_value(value, value_type(declared[key]) if key in declared else None)
            call = call_from_json({"name": name, "parameters": arguments})
            if call is not None:
                calls.append(call)
        return text[:start].strip(), calls, text.count("<tool_call>") - len(calls)


def _glm_value(text: str, kind: str | None) -> Any:
    """One `<arg_value>`: JSON, then JSON after unescaping, then (for a string parameter) the text
    without its quotes, then a Python literal, then the text."""
    value, parsed = None, False
    for read in (json.loads, lambda t: json.loads(json.loads('{"tmp": "' + t + '"}')["tmp"])):
        try:
            value, parsed = read(text), True
            break
        except (ValueError, KeyError):
            pass
    if parsed and kind == "number" and isinstance(value, str):
        value = _number(value)
    if not parsed and kind == "string":
        quoted = len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'"
        value, parsed = (text[1:-1] if quoted else text), True
    if not parsed:
        try:
            value = _literal(text)
        except _LITERAL_ERRORS:
            value = text
    if kind != "string":
        return value
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False) if isinstance(value, (dict, list)) else str(value)


def _number(text: str) -> Any:
    try:
        return float(text) if "." in text or "e" in text.lower() else int(text)
    except ValueError:
        return text
