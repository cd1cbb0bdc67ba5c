"""Where an assistant turn ends in each chat-template family: what keeps an episode one sequence.

An episode's record holds the model's turns as sampled. The ids between two turns (tool results,
user turns and the next generation prompt) are text the model's chat template renders. Rendering
the whole conversation again does not extend the record, because templates render an assistant
turn by where it sits:
- Qwen3 gives the last assistant turn an empty `<think>\\n\\n</think>\\n\\n` block, drops the think
  blocks of turns before the last user query, and (non-thinking) puts an empty one in the
  generation prompt;
- DeepSeek-V3's template writes a single tool call without the end-of-sentence token the model
  samples after it.

So the new messages are rendered after a fixed context, `[CONTEXT, the sampled assistant message,
*new messages]` with the generation prompt, and cut where that assistant turn ends. A family
(`TemplateFamily`) says where that is; `family_of` picks it by a special token only that family's
tokenizers hold. A template whose turn end cannot be found gives None, and the episode forks a
new sequence rather than guess (`moe_rl.agents.episode`).
"""

from __future__ import annotations

import abc
import dataclasses

CONTEXT = {"role": "user", "content": "."}
"""The message rendered before the sampled assistant turn (only what follows the turn is kept)."""


@dataclasses.dataclass(frozen=True)
class TemplateFamily(abc.ABC):
    name: str
    marker: str
    """A special token only this family's tokenizers hold (how `family_of` recognises it)."""

    @abc.abstractmethod
    def environment_start(self, text: str, turn_start: int) -> int | None:
        """The index in `text` where what follows the assistant turn that begins at `turn_start`
        begins; None when the template does not show it."""


@dataclasses.dataclass(frozen=True)
class EndsWithToken(TemplateFamily):
    """The template closes every assistant turn with the token the model samples to end it
    (ChatML: Qwen2.5/Qwen3/Qwen3-Coder `<|im_end|>`, Kimi-K2 `<|im_end|>`, the tiny tokenizer)."""

    turn_end: str

    def environment_start(self, text: str, turn_start: int) -> int | None:
        end = text.find(self.turn_end, turn_start)
        return None if end < 0 else end + len(self.turn_end)


@dataclasses.dataclass(frozen=True)
class StartsWithMessage(TemplateFamily):
    """The template may leave an assistant turn without its end token; the text after it is
    found where the next message opens (DeepSeek-V3/V3.1: a user turn or tool outputs)."""

    message_starts: tuple[str, ...]

    def environment_start(self, text: str, turn_start: int) -> int | None:
        found = [i for i in (text.find(s, turn_start) for s in self.message_starts) if i >= 0]
        return min(found, default=None)


CHATML = EndsWithToken(name="chatml", marker="<|im_end|>", turn_end="<|im_end|>")
DEEPSEEK = StartsWithMessage(
    name="deepseek",
    marker="<｜Assistant｜>",
    message_starts=("<｜User｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁output▁begin｜>"),
)
FAMILIES = (CHATML, DEEPSEEK)


def family_of(tokenizer) -> TemplateFamily:
    """The tokenizer's family; any other template ends turns with the tokenizer's eos token."""
    vocab = tokenizer.get_vocab()
    for family in FAMILIES:
        if family.marker in vocab:
            return family
    return EndsWithToken(name="eos", marker=tokenizer.eos_token, turn_end=tokenizer.eos_token)
