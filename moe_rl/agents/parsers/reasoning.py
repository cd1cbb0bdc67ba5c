"""Reasoning in think tags: `<think>reasoning</think>content` and its variants, as SGLang 0.5.23's
reasoning detectors split a whole turn (`detect_and_parse`).

A turn is in reasoning when the format forces it (the template opened the block in the prompt:
DeepSeek-R1, Qwen3 thinking-only models) or the start tag appears in it; otherwise it is content
as it stands. Leading start tags are dropped; the reasoning runs to the first end tag, or, with no
end tag, to the format's tool-call start (a call written without closing the block), or to the
end of the turn (a turn cut inside its reasoning). Nothing is stripped.
"""

from __future__ import annotations

from typing import ClassVar

from moe_rl.agents.parsers.base import ReasoningParser


class ThinkTags(ReasoningParser):
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    forced: ClassVar[bool] = False
    """Reasoning from the first token, start tag or not."""
    tool_start: ClassVar[str | None] = None
    """A tool call's opening tag, which ends reasoning that has no end tag."""

    def split(self, text):
        if not self.forced and self.start not in text:
            return None, text
        rest = text
        while rest.startswith(self.start):
            rest = rest[len(self.start) :]
        if self.end in rest:
            reasoning, content = rest.split(self.end, 1)
        elif self.tool_start and self.tool_start in rest:
            cut = rest.index(self.tool_start)
            reasoning, content = rest[:cut], rest[cut:]
        else:
            reasoning, content = rest, ""
        return reasoning or None, content


class Qwen3(ThinkTags):
    """Qwen3 (-MoE) hybrid thinking, QwQ; text without <think> is left as it is."""

    name = "qwen3"
    tool_start = "<tool_call>"


class Qwen3Thinking(Qwen3):
    """Qwen3-*-Thinking-2507 (the template opens <think>)."""

    name = "qwen3-thinking"
    forced = True


class DeepSeekR1(ThinkTags):
    """DeepSeek-R1 (reasoning until </think>, start tag or not)."""

    name = "deepseek-r1"
    forced = True


class DeepSeekV3(Qwen3):
    """DeepSeek-V3.1 / V3.2 with thinking on; V3 without."""

    name = "deepseek-v3"


class Glm45(ThinkTags):
    """GLM-4.5, GLM-4.5-Air, GLM-4.6."""

    name = "glm45"
    tool_start = "<tool_call>"


class KimiK2(ThinkTags):
    """Kimi-K2-Thinking, Kimi-K2 (no reasoning)."""

    name = "kimi_k2"
    tool_start = "<|tool_calls_section_begin|>"


class Kimi(ThinkTags):
    """Kimi-VL / Kimi thinking models (◁think▷)."""

    name = "kimi"
    start, end = "◁think▷", "◁/think▷"
