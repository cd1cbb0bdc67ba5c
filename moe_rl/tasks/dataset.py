"""JSONL prompt datasets: the task `"jsonl"` for user data.

One JSON object per line: `prompt` (text, or a list of chat messages as verl and slime datasets
ship them: `[{"role": "user", "content": ...}]`) or `prompt_ids` (token ids), `answer` (any JSON
value, what the reward compares against) and optional `metadata` (an object, passed through to
the samples). Prompts are tokenised with the HF tokenizer of `tokenizer_dir` (model.tokenizer or
model.path; local files only) and responses decoded with it. A message list is rendered with the
tokenizer's chat template and the generation prompt; a text prompt too with
`apply_chat_template` (as one user message), else it is tokenised as it is. The reward is
named by `reward` (see `moe_rl.tasks.registry.get_reward`; default `"math"`). The file is read
and validated once, up front; `prompts(seed)` shuffles it every epoch and cycles forever.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Iterator

from moe_rl.agents.chat import ChatFormat, load_tokenizer
from moe_rl.sample import Sample
from moe_rl.tasks.registry import Prompt, Task, get_reward, register_task


def read_jsonl(path: str | Path) -> list[dict]:
    """Rows of a JSONL file, each checked for `prompt`/`prompt_ids`, `answer`, `metadata`."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"rollout.dataset={str(path)!r}: file not found")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except ValueError as error:
            raise ValueError(f"{where}: not JSON ({error})") from error
        if not isinstance(row, dict) or ("prompt" in row) == ("prompt_ids" in row):
            raise ValueError(
                f"{where}: give exactly one of 'prompt' (text or chat messages) or 'prompt_ids' (token ids)"
            )
        prompt = row.get("prompt")
        if isinstance(prompt, list) and not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in prompt
        ):
            raise ValueError(f"{where}: a chat 'prompt' is a list of {{'role': ..., 'content': ...}} messages")
        if "prompt" in row and not isinstance(prompt, (str, list)):
            raise ValueError(f"{where}: 'prompt' must be text or a list of chat messages")
        ids = row.get("prompt_ids")
        if ids is not None and (not ids or not all(isinstance(t, int) and t >= 0 for t in ids)):
            raise ValueError(f"{where}: 'prompt_ids' must be a non-empty list of token ids >= 0")
        if "answer" not in row:
            raise ValueError(f"{where}: no 'answer' (what the reward compares the response with)")
        if not isinstance(row.get("metadata", {}), dict):
            raise ValueError(f"{where}: 'metadata' must be a JSON object")
        rows.append(row)
    if not rows:
        raise ValueError(f"rollout.dataset={str(path)!r}: no rows")
    return rows


@register_task("jsonl")
class JsonlTask(Task):
    def __init__(
        self,
        path: str | Path | None = None,
        tokenizer_dir: str | Path | None = None,
        reward: str = "math",
        apply_chat_template: bool = False,
    ):
        if path is None:
            raise ValueError("rollout.task='jsonl' needs rollout.dataset (a JSONL file path)")
        self.rows = read_jsonl(path)
        self._reward = get_reward(reward)
        self.apply_chat_template = apply_chat_template
        self.tokenizer = self.chat = None
        needs_tokenizer = any("prompt" in row for row in self.rows)
        if tokenizer_dir is None and needs_tokenizer:
            raise ValueError(
                "rollout.dataset has text or chat prompts: set model.tokenizer (or model.path) to a directory "
                "with the model's tokenizer, or give prompt_ids"
            )
        if tokenizer_dir is not None:
            try:
                self.tokenizer = load_tokenizer(tokenizer_dir)
            except ValueError:
                if needs_tokenizer:
                    raise
        chats = any(isinstance(row.get("prompt"), list) for row in self.rows)
        if self.tokenizer is not None and (chats or (apply_chat_template and needs_tokenizer)):
            self.chat = ChatFormat(self.tokenizer)
        self.prompt_list = [self._prompt(row) for row in self.rows]

    def _prompt(self, row: dict) -> Prompt:
        ids, prompt = row.get("prompt_ids"), row.get("prompt")
        if isinstance(prompt, list):
            ids = self.chat.prompt_ids(prompt)
        elif prompt is not None and self.apply_chat_template:
            ids = self.chat.prompt_ids([{"role": "user", "content": prompt}])
        elif prompt is not None:
            ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        return Prompt(prompt_ids=list(ids), answer=row["answer"], metadata=dict(row.get("metadata", {})))

    def prompts(self, seed: int) -> Iterator[Prompt]:
        rng = random.Random(seed)
        while True:
            order = list(range(len(self.prompt_list)))
            rng.shuffle(order)
            for index in order:
                yield self.prompt_list[index]

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return " ".join(map(str, ids))
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def reward(self, response: str, answer: Any, sample: Sample) -> float:
        return float(self._reward(response, answer, sample))
