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
- `parse(ids)`: the assistant message of a sampled turn: its text, content and tool calls in the
  family's format.

Tool-call formats (`TOOL_CALL_FORMATS`): "hermes", `<tool_call>{"name": ..., "arguments":
{...}}</tool_call>` (Qwen2.5, Qwen3, Hermes, and the tiny tokenizer). Any other name is refused
with the list; a turn whose call text is not valid JSON keeps it as content and counts a tool
error.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from pathlib import Path
from typing import Any

from moe_rl.agents.templates import CONTEXT, family_of

TOOL_CALL_FORMATS = ("hermes",)
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


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
            "function": {"name": self.name, "arguments": json.dumps(self.arguments)},
        }


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
    text: str
    """The sampled text, end-of-turn token removed."""
    content: str
    """The text outside tool calls, stripped."""
    tool_calls: list[ToolCall]
    tool_errors: int
    """Call blocks that were not a JSON object with a name and arguments."""

    def message(self) -> dict:
        """The assistant message in OpenAI's form (what the agent sends back next turn)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [call.openai() for call in self.tool_calls]
        return message


class ChatFormat:
    def __init__(self, tokenizer, tool_call_format: str = "hermes", template_kwargs: dict | None = None):
        if tool_call_format not in TOOL_CALL_FORMATS:
            raise ValueError(
                f"rollout.episode.tool_call_format={tool_call_format!r} is not supported; use one of "
                f"{TOOL_CALL_FORMATS} (Qwen2.5/Qwen3/Hermes <tool_call> JSON)"
            )
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
        cls, directory: str | Path, tool_call_format: str = "hermes", template_kwargs: dict | None = None
    ) -> "ChatFormat":
        return cls(load_tokenizer(directory), tool_call_format, template_kwargs)

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

    def parse(self, ids: list[int]) -> ParsedTurn:
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        if ids and ids[-1] == self.eos_id:
            text = text[: -len(self.eos_text)] if text.endswith(self.eos_text) else text
        calls, errors = [], 0

        def take(match: re.Match) -> str:  # a parsed call leaves the content; a broken one stays in it
            nonlocal errors
            try:
                call = json.loads(match.group(1))
                if not isinstance(call.get("name"), str) or not isinstance(call.get("arguments", {}), dict):
                    raise ValueError(match.group(1))
            except (ValueError, AttributeError):
                errors += 1
                return match.group(0)
            calls.append(ToolCall(call["name"], call.get("arguments", {})))
            return ""

        content = _HERMES.sub(take, text).strip()
        return ParsedTurn(text=text, content=content, tool_calls=calls, tool_errors=errors)


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
