"""Tool-call and reasoning parsing (`moe_rl.agents.parsers`) against SGLang 0.5.23's own detectors.

The same texts go through ours and through SGLang's (`<X>Detector.detect_and_parse(text, tools)`,
`ReasoningParser(name).parse_non_stream(text)`), with the same tools: a well-formed call, several
calls, text before and after them, malformed arguments, a call cut by max_tokens, no call, and a
call to a function the request did not declare. Content and calls (name and decoded arguments)
must be equal, except where `DIFFERENCES` says why not; there the calls SGLang keeps are checked
against ours. The table of docs/agents.md is this file's result.
"""

from __future__ import annotations

import ast
import json

import pytest

from moe_rl.agents import parsers
from tests.conformance import sglang_oracle

pytestmark = pytest.mark.world  # runs SGLang's code in a child process (tests/conftest.py)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "filters": {"type": "object"}, "limit": {"type": "number"}},
            },
        },
    },
]
WEATHER = ("get_weather", {"city": "Paris", "days": 3, "metric": True})
SEARCH = ("search", {"query": "hotels in Paris", "filters": {"stars": 4, "near": ["Louvre"]}, "limit": 5})
UNDECLARED = ("book_flight", {"to": "Rome"})
BROKEN = ("get_weather", '{"city": "Rome", "days": }')  # the JSON formats' malformed arguments


def _json(args) -> str:
    return args if isinstance(args, str) else json.dumps(args)


def _value(value) -> str:  # how the XML formats write one argument
    return value if isinstance(value, str) else json.dumps(value)


WRITERS = {  # format -> (one call, how calls are joined into the turn's tool-call text)
    "qwen25": (lambda n, a: '<tool_call>\n{"name": "%s", "arguments": %s}\n</tool_call>' % (n, _json(a)), "\n".join),
    "hermes": (lambda n, a: '<tool_call>{"name": "%s", "arguments": %s}</tool_call>' % (n, _json(a)), "".join),
    "deepseekv3": (
        lambda n, a: f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{_json(a)}\n```<｜tool▁call▁end｜>",
        lambda calls: "<｜tool▁calls▁begin｜>" + "\n".join(calls) + "<｜tool▁calls▁end｜>",
    ),
    "deepseekv31": (
        lambda n, a: f"<｜tool▁call▁begin｜>{n}<｜tool▁sep｜>{_json(a)}<｜tool▁call▁end｜>",
        lambda calls: "<｜tool▁calls▁begin｜>" + "".join(calls) + "<｜tool▁calls▁end｜>",
    ),
    "kimi_k2": (
        lambda n, a: f"<|tool_call_begin|>functions.{n}:0<|tool_call_argument_begin|>{_json(a)}<|tool_call_end|>",
        lambda calls: "<|tool_calls_section_begin|>" + "".join(calls) + "<|tool_calls_section_end|>",
    ),
    "qwen3_coder": (
        lambda n, a: (
            f"<tool_call>\n<function={n}>\n"
            + "".join(f"<parameter={k}>\n{_value(v)}\n</parameter>\n" for k, v in a.items())
            + "</function>\n</tool_call>"
        ),
        "\n".join,
    ),
    "glm45": (
        lambda n, a: (
            f"<tool_call>{n}\n"
            + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{_value(v)}</arg_value>\n" for k, v in a.items())
            + "</tool_call>"
        ),
        "\n".join,
    ),
    "gpt-oss": (
        lambda n, a: (
            f"<|start|>assistant<|channel|>commentary to=functions.{n} <|constrain|>json<|message|>{_json(a)}<|call|>"
        ),
        lambda calls: "<|channel|>analysis<|message|>The user wants the weather.<|end|>" + "".join(calls),
    ),
}
XML_BROKEN = ("search", {"query": "hotels", "filters": '{"stars": }'})  # an object argument that is not JSON
NO_TOOLS = "several, no tools declared"
DECLARED = {tool["function"]["name"] for tool in TOOLS}


def tools_of(case: str) -> list[dict]:
    return [] if case == NO_TOOLS else TOOLS


def tool_cases(fmt: str) -> dict[str, str]:
    call, join = WRITERS[fmt]
    single = join([call(*WEATHER)])
    broken = XML_BROKEN if fmt in ("qwen3_coder", "glm45") else BROKEN
    cut = single[: single.index("Paris") + 3]
    if fmt in ("qwen3_coder", "glm45"):  # cut inside the second argument, after a whole first one
        cut = single[: single.index("3") + 1]
    cases = {
        "single": single,
        "several": join([call(*WEATHER), call(*SEARCH)]),
        "text around": "Let me check the weather.\n" + single + "\nI will wait for it.",
        "malformed": join([call(*SEARCH), call(*broken)]),
        "cut at max_tokens": cut,
        "no call": "The weather in Paris is sunny.",
        "undeclared function": join([call(*UNDECLARED), call(*WEATHER)]),
    }
    if fmt in ("qwen3_coder", "glm45"):  # argument types without a schema
        cases[NO_TOOLS] = cases["several"]
    if fmt == "kimi_k2":  # the name comes from the tools whose properties match the arguments
        cases["bare counter id"] = join([call(*SEARCH).replace("functions.search:0", "3")])
    return cases


UNDECLARED_KEPT = (
    "SGLang drops a call to a function the request did not declare; moe-rl returns it, as SGLang does with "
    "SGLANG_FORWARD_UNKNOWN_TOOLS=1"
)
NOT_JSON_DROPPED = "SGLang passes arguments that are not JSON on as text; moe-rl drops the call, counting an error"
DIFFERENCES = {
    **{
        (fmt, "undeclared function"): UNDECLARED_KEPT
        for fmt in ("qwen25", "hermes", "deepseekv3", "deepseekv31", "glm45", "gpt-oss")
    },
    ("glm45", NO_TOOLS): UNDECLARED_KEPT,
    ("kimi_k2", "malformed"): NOT_JSON_DROPPED,
}
ERRORS = {  # (format, case) -> tool errors moe-rl counts; 0 where not listed
    **{(fmt, "cut at max_tokens"): 1 for fmt in WRITERS if fmt != "qwen3_coder"},  # qwen3_coder reads what it holds
    **{(fmt, "malformed"): 1 for fmt in ("qwen25", "kimi_k2", "gpt-oss")},  # the XML formats keep the text
    **{(fmt, "malformed"): 2 for fmt in ("hermes", "deepseekv3", "deepseekv31")},  # one bad call drops both
}

REASONING_CASES = {
    "think block": "<think>The user wants Paris.</think>It is sunny.",
    "think block with newlines": "<think>\nThe user wants Paris.\n</think>\n\nIt is sunny.",
    "end tag only": "The user wants Paris.</think>It is sunny.",
    "no reasoning": "It is sunny in Paris.",
    "empty block": "<think></think>It is sunny.",
    "cut in reasoning": "<think>The user wants Par",
    "call inside the block": "<think>I will call it." + WRITERS["qwen25"][0]("get_weather", {}),
    "kimi call inside the block": "<think>I will call it.<|tool_calls_section_begin|><|tool_call_begin|>",
    "kimi tags": "◁think▷The user wants Paris.◁/think▷It is sunny.",
}
HARMONY_CASES = {
    "analysis and final": "<|channel|>analysis<|message|>The user wants Paris.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>It is sunny.",
    "final with return": "<|channel|>final<|message|>It is sunny.<|return|>",
    "analysis and call": tool_cases("gpt-oss")["single"],
    "preamble and call": "<|channel|>analysis<|message|>Weather.<|end|><|start|>assistant<|channel|>commentary"
    "<|message|>Checking.<|end|>" + WRITERS["gpt-oss"][0](*WEATHER),
    "cut in analysis": "<|channel|>analysis<|message|>The user wants Par",
    "cut in a call": tool_cases("gpt-oss")["cut at max_tokens"],
    "cut marker": "<|channel|>final<|message|>It is sunny.<|ret",
}
TURNS = {  # (tool-call format, reasoning parser) -> one whole turn with reasoning and calls
    ("qwen25", "qwen3"): "<think>\nThe user wants Paris.\n</think>\n\nChecking.\n" + tool_cases("qwen25")["several"],
    ("qwen3_coder", "qwen3"): "Checking.\n" + tool_cases("qwen3_coder")["several"],
    ("deepseekv3", "deepseek-v3"): "Checking." + tool_cases("deepseekv3")["several"],
    ("deepseekv31", "deepseek-v3"): "<think>Paris.</think>Checking." + tool_cases("deepseekv31")["several"],
    ("glm45", "glm45"): "<think>The user wants Paris.</think>\n" + tool_cases("glm45")["several"],
    ("kimi_k2", "kimi_k2"): "<think>Paris.</think>Checking." + tool_cases("kimi_k2")["several"],
    ("gpt-oss", "gpt-oss"): HARMONY_CASES["preamble and call"],
}


# -- run in the oracle process ----------------------------------------------------------------------


def _sglang_names(module: str, table: str) -> dict[str, tuple[str, str]]:
    """SGLang's registry `table` (name -> class) as (module, class) pairs, read from its source: the
    module of the whole tool-call registry imports xgrammar, which the oracle does not install."""
    tree = ast.parse((sglang_oracle.cache_dir() / "wheel" / (module.replace(".", "/") + ".py")).read_text())
    where = {a.name: node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for a in node.names}
    entries = next(
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == table
    )
    return {k.value: (where.get(v.id, module), v.id) for k, v in zip(entries.keys, entries.values)}


def _sglang_results(tool_texts, reasoning_texts, turns, tools):
    """SGLang's (content, calls) of each (format, text, tools), by default and with unknown tools
    forwarded; (reasoning, content) of each (parser, text); (reasoning, content, calls) of each
    (format, parser, text) turn."""
    import importlib
    import os

    from sglang.srt.entrypoints.openai.protocol import Tool
    from sglang.srt.parser.reasoning_parser import ReasoningParser

    registry = _sglang_names("sglang.srt.function_call.function_call_parser", "ToolCallParserEnum")

    def detect(fmt, text, declared=tools, forward_unknown=False):
        module, name = registry[fmt]
        detector = getattr(importlib.import_module(module), name)()
        os.environ["SGLANG_FORWARD_UNKNOWN_TOOLS"] = str(forward_unknown)  # read at every call
        result = detector.detect_and_parse(text, [Tool(**tool) for tool in declared])
        return result.normal_text, [(call.name, call.parameters) for call in result.calls]

    def split(name, text):
        reasoning, content = ReasoningParser(model_type=name, stream_reasoning=False).parse_non_stream(text)
        return reasoning or None, content

    def turn(fmt, name, text):
        reasoning, content = split(name, text)
        return (reasoning, *detect(fmt, content))

    return (
        [(detect(fmt, text, declared), detect(fmt, text, declared, True)) for fmt, text, declared in tool_texts],
        [split(name, text) for name, text in reasoning_texts],
        [turn(fmt, name, text) for fmt, name, text in turns],
    )


# -- the tests --------------------------------------------------------------------------------------

TOOL_TEXTS = [(fmt, case, text) for fmt in WRITERS for case, text in tool_cases(fmt).items()]
REASONING_TEXTS = [
    *(
        (name, case, text)
        for name in sorted(parsers.REASONING_PARSERS)
        if name != "gpt-oss"
        for case, text in REASONING_CASES.items()
    ),
    *(("gpt-oss", case, text) for case, text in HARMONY_CASES.items()),
]


@pytest.fixture(scope="module")
def sglang():
    tools, reasoning, turns = sglang_oracle.call(
        _sglang_results,
        [(fmt, text, tools_of(case)) for fmt, case, text in TOOL_TEXTS],
        [(name, text) for name, _, text in REASONING_TEXTS],
        [(fmt, name, text) for (fmt, name), text in TURNS.items()],
        TOOLS,
    )
    return (
        {(fmt, case): result for (fmt, case, _), result in zip(TOOL_TEXTS, tools)},
        {(name, case): result for (name, case, _), result in zip(REASONING_TEXTS, reasoning)},
        dict(zip(TURNS, turns)),
    )


def _decoded(calls: list[tuple[str, str]]) -> list[tuple[str, object]]:
    return [(name, json.loads(arguments)) for name, arguments in calls]


def _objects(calls: list[tuple[str, str]]) -> list[tuple[str, object]]:
    """SGLang's calls whose arguments are a JSON object (the only calls moe-rl returns)."""
    kept = []
    for name, arguments in calls:
        try:
            value = json.loads(arguments)
        except ValueError:
            continue
        if isinstance(value, dict):
            kept.append((name, value))
    return kept


def test_our_names_are_sglangs_and_tool_aliases_share_a_detector():
    reasoning = _sglang_names("sglang.srt.parser.reasoning_parser", "DetectorMap")
    assert set(parsers.REASONING_PARSERS) <= set(reasoning)
    tools = _sglang_names("sglang.srt.function_call.function_call_parser", "ToolCallParserEnum")
    ours = parsers.TOOL_PARSERS
    assert set(ours) <= set(tools)
    for a in ours:
        for b in ours:  # two of our names share a parser exactly when SGLang's share a detector
            assert (ours[a] is ours[b]) == (tools[a] == tools[b]), (a, b)


@pytest.mark.parametrize(
    "fmt, case", [(fmt, case) for fmt, case, _ in TOOL_TEXTS], ids=[f"{f}/{c}" for f, c, _ in TOOL_TEXTS]
)
def test_tool_calls_equal_sglangs(sglang, fmt, case):
    text = tool_cases(fmt)[case]
    content, calls, errors = parsers.tool_parser(fmt).parse(text, tools_of(case) or None)
    (their_content, their_calls), (forwarded_content, forwarded_calls) = sglang[0][fmt, case]
    ours = [(call.name, call.arguments) for call in calls]
    assert content == their_content == forwarded_content
    difference = DIFFERENCES.get((fmt, case))
    if difference is None:
        assert ours == _decoded(their_calls)
    elif difference == UNDECLARED_KEPT:
        assert ours == _decoded(forwarded_calls) and len(ours) > len(their_calls)
        assert [call for call in ours if call[0] in DECLARED and tools_of(case)] == _decoded(their_calls)
    else:
        assert ours == _objects(their_calls) and len(their_calls) == len(ours) + 1
    assert errors == ERRORS.get((fmt, case), 0)


@pytest.mark.parametrize(
    "name, case", [(name, case) for name, case, _ in REASONING_TEXTS], ids=[f"{n}/{c}" for n, c, _ in REASONING_TEXTS]
)
def test_reasoning_equals_sglangs(sglang, name, case):
    text = dict(REASONING_CASES, **HARMONY_CASES)[case]
    assert parsers.reasoning_parser(name).split(text) == sglang[1][name, case]


@pytest.mark.parametrize("fmt, name", list(TURNS), ids=[f"{f}+{n}" for f, n in TURNS])
def test_a_whole_turn_equals_sglangs_chat_server(sglang, fmt, name):
    """Reasoning first, tool calls on the content it leaves (serving_chat.py's order)."""
    reasoning, rest = parsers.reasoning_parser(name).split(TURNS[fmt, name])
    content, calls, errors = parsers.tool_parser(fmt).parse(rest, TOOLS)
    their_reasoning, their_content, their_calls = sglang[2][fmt, name]
    assert (reasoning, content, errors) == (their_reasoning, their_content, 0)
    assert [(call.name, call.arguments) for call in calls] == _decoded(their_calls) != []
