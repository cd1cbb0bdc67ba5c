"""The tiny chat tokenizer: a real `tokenizers` BPE with a chat template, for the tiny models.

The CPU demos and tests go through the same path as a real model (`apply_chat_template` with
`tools`, Qwen tool calls, `<|im_end|>` ending a turn), with a vocabulary that fits the tiny
models (< 128 ids):
- the specials `<|endoftext|>` (pad), `<|im_start|>`, `<|im_end|>` (EOS, ends a turn);
- printable ASCII and newline, one id per character, plus a few merges (`ke`, `key`, ...), so
  decoding sampled ids and encoding the text again can give other ids (the drift a
  token-in-token-out record avoids);
- the role names and the tool's name as one token each (`system`, `user`, `assistant`,
  `lookup`), as in a real vocabulary: spelled by characters they made the lookup prompt 41
  tokens instead of 21, and a tiny model's attention harder to aim at what the turns hold;
- one added token per whole `lookup` tool call (`<tool_call>\\n{"name": "lookup", "arguments":
  {"key": "C"}}\\n</tool_call>` for each key A..J): a random-init model can emit a valid call in
  one token, so the agent demo learns in minutes. A real tokenizer spells a call in many tokens;
  the same parser (Qwen's, "qwen25") reads both;
- reserved specials up to `VOCAB_SIZE` (128), the tiny models' vocabulary, so every id a model
  samples is a token.

The template is Qwen's ChatML layout: `<|im_start|>{role}\\n{content}<|im_end|>\\n`, the tool
names in a system turn when `tools` are given, assistant tool calls as Qwen writes them
(`<tool_call>\\n{json}\\n</tool_call>`), tool results as role `tool`.

`python -m moe_rl.agents.tiny_tokenizer DIR` writes it; `configs/tokenizers/tiny_chat/` is that
output (a test checks they agree).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
KEYS = "ABCDEFGHIJ"
VOCAB_SIZE = 128
MERGES = (("k", "e"), ("ke", "y"), ("o", "o"), ("t", "oo"), ("too", "l"))
WORDS = ("system", "user", "assistant", "lookup")


def lookup_call(key: str) -> str:
    """The text of one `lookup` call, as Qwen writes it (what the tiny tokenizer holds as one token)."""
    return "<tool_call>\n" + json.dumps({"name": "lookup", "arguments": {"key": key}}) + "\n</tool_call>"


CHAT_TEMPLATE = (  # no whitespace control: every newline below is part of the rendering
    "{% if tools %}<|im_start|>system\ntools:{% for tool in tools %} "
    "{{ tool.function.name if tool.function is defined else tool.name }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.content %}{{ message.content }}{% endif %}"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}"
    "{% set fn = call.function if call.function is defined else call %}"
    '<tool_call>\n{"name": "{{ fn.name }}", "arguments": '
    "{{ fn.arguments if fn.arguments is string else fn.arguments | tojson }}}\n</tool_call>"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build(out_dir: str | Path) -> Path:
    """Write tokenizer.json and tokenizer_config.json (with the chat template) to `out_dir`."""
    # heavy: transformers, only where an HF config, model or tokenizer is read
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    for token in chars + ["".join(pair) for pair in MERGES]:
        vocab[token] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=list(MERGES)))
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tokenizer.add_tokens([AddedToken(lookup_call(k), normalized=False) for k in KEYS])
    tokenizer.add_tokens([AddedToken(word, normalized=False) for word in WORDS])  # after the calls: their ids stay
    reserved = [f"<|reserved_{i}|>" for i in range(VOCAB_SIZE - tokenizer.get_vocab_size())]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in reserved])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
    out = Path(out_dir)
    fast.save_pretrained(out)
    return out


if __name__ == "__main__":
    print(build(sys.argv[1]))
