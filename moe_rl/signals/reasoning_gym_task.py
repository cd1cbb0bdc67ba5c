"""`rollout.environment: {kind: reasoning_gym, name: <dataset>[,<dataset>...], options}`:
reasoning-gym's procedural prompts, scored by each dataset's own `score_answer`.

- Datasets: `reasoning_gym.create_dataset(name, **options)` per name (the dataset's config
  fields: `seed`, `size`, difficulty knobs). Prompts take the datasets in turn (one each), item
  by item, cycling after `size` items; `options.seed` (default 0) fixes the items, so an eval
  split is the same dataset with another seed.
- A prompt: the system prompt (`options.system_prompt`: a name of
  `reasoning_gym.utils.SYSTEM_PROMPTS`, default "default", which asks for `<answer>` tags; or
  its own text; "" for none) and the item's question, rendered with the model's chat template
  and the generation prompt (as plain text where the tokenizer has no template).
- The reward: `dataset.score_answer(answer, entry)` of the regenerated entry, where `answer` is
  reasoning-gym's `extract_answer` of the response (`options.extract_answer: false`: the whole
  response). The prompt's answer is `{"dataset", "index"}`: JSON-safe in dumps and run
  checkpoints, and the entry regenerates exactly from it.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterator

import reasoning_gym
from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer

from moe_rl.agents.chat import load_tokenizer
from moe_rl.sample import Sample
from moe_rl.tasks import Prompt, Task


class ReasoningGymTask(Task):
    name = "reasoning_gym"

    def __init__(self, names: list[str], options: dict[str, Any], tokenizer_dir: str | None):
        if tokenizer_dir is None:
            raise ValueError("reasoning_gym renders its questions with the model's tokenizer: set model.tokenizer")
        options = {"seed": 0, **options}
        system = options.pop("system_prompt", "default")
        self.system_prompt = SYSTEM_PROMPTS.get(system, system)
        self.extract = bool(options.pop("extract_answer", True))
        self.names = names
        self.datasets = {}
        for name in names:
            try:
                self.datasets[name] = reasoning_gym.create_dataset(name, **options)
            except (ValueError, TypeError, AssertionError) as error:  # unknown name, option or value
                raise ValueError(f"reasoning_gym dataset {name!r} with options {options}: {error}") from None
        self.tokenizer = load_tokenizer(tokenizer_dir)

    def prompts(self, seed: int) -> Iterator[Prompt]:
        for i in itertools.count():
            name = self.names[i % len(self.names)]
            dataset = self.datasets[name]
            index = (i // len(self.names)) % len(dataset)
            entry = dataset[index]
            messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
            messages.append({"role": "user", "content": entry["question"]})
            yield Prompt(
                prompt_ids=self._render(messages),
                answer={"dataset": name, "index": index},
                metadata={"dataset": name, "question": entry["question"]},
            )

    def _render(self, messages: list[dict]) -> list[int]:
        if self.tokenizer.chat_template:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:
            text = "\n".join(m["content"] for m in messages) + "\n"
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def reward(self, response: str, answer: dict, sample: Sample) -> float:
        dataset = self.datasets[answer["dataset"]]
        entry = dataset[answer["index"]]
        return float(dataset.score_answer(extract_answer(response) if self.extract else response, entry))


def make_task(name: str, options: dict[str, Any], tokenizer_dir: str | None) -> ReasoningGymTask:
    names = [n.strip() for n in name.split(",")]
    if not all(names):
        raise ValueError(f"name={name!r}: give dataset names separated by commas")
    return ReasoningGymTask(names, options, tokenizer_dir)
