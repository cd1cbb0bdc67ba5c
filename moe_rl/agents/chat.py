"""`ChatFormat`: a model's chat template and tool-call format, as token ids that extend a record.

Owns the token-in-token-out contract of episodes:
- `prompt_ids(messages, tools)`: the first prompt, rendered with the tokenizer's own chat
  template (`apply_chat_template` with `tools` and the generation prompt; local files only).
- `extension_ids(history, messages, tools, turn_ended)`: what a new call adds. `history` is the
  conversation the record already holds, ending with the assistant turn the model sampled. If
  `messages` starts with `history` (same roles, contents and tool calls), the new messages are
  rendered after that assistant turn and only the text after the turn's end is tokenized (plus
  the end-of-turn token when the turn was cut by its budget): tool results, user turns, the
  template's glue and the generation prompt. Sampled tokens are never re-tokenized, and what the
  template does to earlier turns (think blocks dropped or moved) does not split the sequence:
  `moe_rl.agents.templates` holds each family's rule. Otherwise it returns None: the agent
  rewrote its history and the episode starts a new sequence (`moe_rl.agents.episode`).
- `parse(ids, tools)`: the assistant message of a sampled turn: its text, reasoning, content and
  tool calls, read by the family's reasoning parser and then its tool-call parser
  (`moe_rl.agents.parsers`, SGLang's names and behaviour: `rollout.episode.reasoning_parser`,
  `rollout.episode.tool_call_format`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from moe_rl.agents import parsers
from moe_rl.agents.parsers import ToolCall
from moe_rl.agents.templates import CONTEXT, family_of


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
    text: str
    """The sampled text, end-of-turn token removed."""
    content: str
    """The text outside reasoning and tool calls, as SGLang's parsers leave it."""
    tool_calls: list[ToolCall]
    tool_errors: int
    """Calls the model began that did not parse (`moe_rl.agents.parsers.base`)."""
    reasoning: str | None = None
    """The turn's reasoning (a think block, harmony's analysis channel), None without one."""

    def message(self) -> dict:
        """The assistant message in OpenAI's form (what the agent sends back next turn)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = [call.openai() for call in self.tool_calls]
        return message


class ChatFormat:
    def __init__(
        self,
        tokenizer,
        tool_call_format: str = "qwen25",
        reasoning_parser: str = "qwen3",
        template_kwargs: dict | None = None,
    ):
        """`tool_call_format`, `reasoning_parser`: SGLang's parser names (`moe_rl.agents.parsers`)."""
        self.tool_parser = parsers.tool_parser(tool_call_format)
        self.reasoning_parser = parsers.reasoning_parser(reasoning_parser)
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"the tokenizer {tokenizer.name_or_path!r} has no chat template: agents and chat-format "
                "datasets need one (tokenizer_config.json 'chat_template' or chat_template.jinja)"
            )
        if tokenizer.eos_token is None:
            raise ValueError(f"the tokenizer {tokenizer.name_or_path!r} has no eos_token (the end of a turn)")
        self.tokenizer = tokenizer
        self.eos_text, self.eos_id = tokenizer.eos_token, tokenizer.eos_token_id
        self.family = family_of(tokenizer)
        self.template_kwargs = dict(template_kwargs or {})  # e.g. Qwen3's enable_thinking

    @classmethod
    def load(
        cls,
        directory: str | Path,
        tool_call_format: str = "qwen25",
        reasoning_parser: str = "qwen3",
        template_kwargs: dict | None = None,
    ) -> "ChatFormat":
        return cls(load_tokenizer(directory), tool_call_format, reasoning_parser, template_kwargs)

    def render(self, messages: list[dict], tools: list[dict] | None, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            tokenize=False,
            add_generation_prompt=generation_prompt,
            **self.template_kwargs,
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        return self.encode(self.render(messages, tools, True))

    def extension_ids(
        self, history: list[dict], messages: list[dict], tools: list[dict] | None, turn_ended: bool
    ) -> list[int] | None:
        """Ids that make a record of `history` read as `messages` + the generation prompt, or None
        when `messages` does not extend `history` or the template does not show where the turn
        ends (see the module docstring and `moe_rl.agents.templates`)."""
        if len(messages) <= len(history) or not all(map(same_message, history, messages)):
            return None
        head = self.render([CONTEXT], tools, False)
        text = self.render([CONTEXT, history[-1], *messages[len(history) :]], tools, True)
        start = self.family.environment_start(text, len(head)) if text.startswith(head) else None
        if start is None:
            return None
        return self.encode(("" if turn_ended else self.eos_text) + text[start:])

    def parse(self, ids: list[int], tools: list[dict] | None = None) -> ParsedTurn:
        """The turn of sampled `ids`; `tools` (the request's) types arguments where the format
        writes them as text."""
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        if ids and ids[-1] == self.eos_id:
            text = text[: -len(self.eos_text)] if text.endswith(self.eos_text) else text
        reasoning, rest = self.split_reasoning(text)
        content, calls, errors = self.tool_parser.parse(rest, tools)
        return ParsedTurn(text, content, calls, errors, reasoning)

    def split_reasoning(self, text: str) -> tuple[str | None, str]:
        """(reasoning, the rest) of a turn's text; (None, text) where the format has no reasoning parser."""
        return self.reasoning_parser.split(text) if self.reasoning_parser else (None, text)


def load_tokenizer(directory: str | Path):
    """The HF tokenizer of a model (or tokenizer) directory, local files only."""
    from transformers import AutoTokenizer  # heavy: only where prompts are rendered

    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError) as error:
        raise ValueError(
            f"no tokenizer in {str(directory)!r} ({error}): set model.tokenizer to a directory with "
            "tokenizer.json / tokenizer_config.json"
        ) from error


def same_message(a: dict, b: dict) -> bool:
    """Equal as a chat turn: role, content (None = ""), tool calls by name and parsed arguments."""
    return _key(a) == _key(b)


def _key(message: dict) -> tuple:
    calls = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call)
        arguments = fn.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass
        calls.append((fn.get("name"), json.dumps(arguments, sort_keys=True)))
    return message.get("role"), message.get("content") or "", tuple(calls)
