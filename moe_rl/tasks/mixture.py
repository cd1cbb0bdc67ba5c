"""`TaskMixture`: the prompt source of `rollout.tasks`, several tasks whose prompts are drawn by weight.

Draws: a `random.Random(seed)` picks the entry of every prompt, each with probability weight /
sum of weights (`random.choices`); that entry's task gives its next prompt from its own stream,
`task.prompts(seed)`. The n-th prompt of a mixture is therefore a function of the seed alone: a
resumed run replays the draws made before its checkpoint (`RolloutManager.restore` skips
`next_group` prompts) and goes on exactly as an uninterrupted run. The run checkpoint records the
entries' names and weights (`RolloutConfig.mixture_signature`); a resume with other ones is refused.

Contract: every prompt carries its entry's name (`Prompt.task`) and every sample of it
`sample.metadata["task"]` (None outside a mixture). The rollout decodes and scores a sample with
its entry's task and reward (`parts[name]`), and logs per task under `rollout/task/<name>/`;
dumps carry the name; per-task teachers read it. A request stops at any entry's stop token
(`stop_token_ids` is their union: one engine request list for the mixture).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any, Iterator

from moe_rl.sample import Sample
from moe_rl.tasks.registry import Prompt, RewardFn, Task

TASK_METRICS = "rollout/task"
"""Where a mixture's per-task metrics go: `rollout/task/<name>/reward_mean`, ..."""


@dataclasses.dataclass(frozen=True)
class MixturePart:
    """One entry of a mixture: its task, its share of the prompts and its reward."""

    weight: float
    task: Task
    reward: RewardFn


class TaskMixture(Task):
    name = "mixture"

    def __init__(self, parts: dict[str, MixturePart]):
        if not parts:
            raise ValueError("TaskMixture: give at least one task")
        self.parts = parts
        self.stop_token_ids = sorted({t for part in parts.values() for t in part.task.stop_token_ids})

    def prompts(self, seed: int) -> Iterator[Prompt]:
        rng = random.Random(seed)
        names = list(self.parts)
        weights = [self.parts[name].weight for name in names]
        streams = {name: self.parts[name].task.prompts(seed) for name in names}
        while True:
            (name,) = rng.choices(names, weights)
            yield dataclasses.replace(next(streams[name]), task=name)

    def decode(self, ids: list[int]) -> str:
        """The first entry's decoding: the dumps' text when the model has no tokenizer (samples are
        decoded for their reward by their own entry's task)."""
        return next(iter(self.parts.values())).task.decode(ids)

    def reward(self, response: str, answer: Any, sample: Sample) -> float:
        """The reward of the sample's entry."""
        return self.parts[sample.metadata["task"]].reward(response, answer, sample)
