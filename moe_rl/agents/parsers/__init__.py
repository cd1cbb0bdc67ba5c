"""Tool-call and reasoning parsing per model family: what a sampled turn becomes as an OpenAI
message (`content`, `tool_calls`, `reasoning_content`).

Formats are named as SGLang 0.5.23 names them (`--tool-call-parser`, `--reasoning-parser`) and
follow its detectors on a whole turn; tests/conformance/test_tool_parsers.py checks each against
SGLang's own code, and docs/agents.md lists what agrees and where moe-rl differs on purpose. A
turn goes through the reasoning parser first and the tool parser on the content it leaves, as
SGLang's chat server does.

- `TOOL_PARSERS`, `REASONING_PARSERS`: the registries; `tool_parser(name)`,
  `reasoning_parser(name)` build one (ValueError naming the `rollout.episode` field otherwise).
- `FAMILY_FORMATS` / `family_formats(model_type)`: what `auto` means for an HF `model_type`.
- `base`: `ToolCall` and the two interfaces; `json_calls`, `xml_calls`, `harmony`, `reasoning`:
  the formats.
"""

from __future__ import annotations

from moe_rl.agents.parsers import harmony, json_calls, reasoning, xml_calls
from moe_rl.agents.parsers.base import ReasoningParser, ToolCall, ToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "qwen25": json_calls.Qwen25,
    "qwen": json_calls.Qwen25,
    "hermes": json_calls.Hermes,
    "qwen3_coder": xml_calls.Qwen3Coder,
    "deepseekv3": json_calls.DeepSeekV3,
    "deepseekv31": json_calls.DeepSeekV31,
    "glm45": xml_calls.Glm45,
    "glm": xml_calls.Glm45,
    "kimi_k2": json_calls.KimiK2,
    "gpt-oss": harmony.GptOss,
}
"""SGLang's name -> the parser; "qwen" and "glm" are SGLang's aliases of "qwen25" and "glm45"."""

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": reasoning.Qwen3,
    "qwen3-thinking": reasoning.Qwen3Thinking,
    "deepseek-r1": reasoning.DeepSeekR1,
    "deepseek-v3": reasoning.DeepSeekV3,
    "glm45": reasoning.Glm45,
    "kimi_k2": reasoning.KimiK2,
    "kimi": reasoning.Kimi,
    "gpt-oss": harmony.GptOssReasoning,
}

FAMILY_FORMATS: dict[str, tuple[str, str]] = {
    "qwen2": ("qwen25", "qwen3"),
    "qwen2_moe": ("qwen25", "qwen3"),
    "qwen3": ("qwen25", "qwen3"),
    "qwen3_moe": ("qwen25", "qwen3"),
    "deepseek_v3": ("deepseekv3", "deepseek-v3"),
    "glm4_moe": ("glm45", "glm45"),
    "kimi_k2": ("kimi_k2", "kimi_k2"),
    "gpt_oss": ("gpt-oss", "gpt-oss"),
}
"""HF model_type -> (tool-call format, reasoning parser) that `auto` picks. Same model type, other
format: Qwen3-Coder (qwen3_moe) writes qwen3_coder, DeepSeek-V3.1 (deepseek_v3) deepseekv31, a
Qwen3 thinking-only model needs qwen3-thinking: set those by name."""

FIELD = "rollout.episode"


def tool_parser(name: str) -> ToolParser:
    _check_resolved("tool_call_format", name)
    if name not in TOOL_PARSERS:
        raise ValueError(
            f"{FIELD}.tool_call_format={name!r}: not a tool-call format; use 'auto' (by the model type) or one "
            f"of {sorted(TOOL_PARSERS)} (SGLang's --tool-call-parser names)"
        )
    return TOOL_PARSERS[name]()


def reasoning_parser(name: str) -> ReasoningParser | None:
    """The parser, or None for "none" (the whole turn is content)."""
    if name == "none":
        return None
    _check_resolved("reasoning_parser", name)
    if name not in REASONING_PARSERS:
        raise ValueError(
            f"{FIELD}.reasoning_parser={name!r}: not a reasoning parser; use 'auto' (by the model type), 'none' "
            f"or one of {sorted(REASONING_PARSERS)} (SGLang's --reasoning-parser names)"
        )
    return REASONING_PARSERS[name]()


def _check_resolved(field: str, name: str) -> None:
    if name == "auto":
        raise ValueError(
            f"{FIELD}.{field}='auto' is resolved from the model's type when the run config loads "
            f"(EpisodeConfig.resolved); a chat format built without one needs the format's name"
        )


def family_formats(model_type: str) -> tuple[str, str]:
    """(tool-call format, reasoning parser) of an HF model_type, for `auto`."""
    if model_type not in FAMILY_FORMATS:
        raise ValueError(
            f"{FIELD}.tool_call_format / reasoning_parser 'auto': no formats known for model type "
            f"{model_type!r} (known: {sorted(FAMILY_FORMATS)}); set {FIELD}.tool_call_format to one of "
            f"{sorted(TOOL_PARSERS)} and {FIELD}.reasoning_parser to 'none' or one of {sorted(REASONING_PARSERS)}"
        )
    return FAMILY_FORMATS[model_type]


__all__ = [
    "FAMILY_FORMATS",
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "ReasoningParser",
    "ToolCall",
    "ToolParser",
    "family_formats",
    "reasoning_parser",
    "tool_parser",
]
