"""Tasks and rewards for RL: prompt sources with verifiable rewards.

- `registry`: `Task`, `Prompt`, `@register_task`, `@register_reward`, `make_task`, `get_reward`
  (registered names, task names, or `module:function`).
- `math`: the `"math"` reward (the final \\boxed{} answer, else math-verify's own extraction, vs
  the reference, graded by HF math-verify in a child process with a time limit).
- `digits`: built-in tasks with their own token vocabulary (`copy_digits`, `reverse_digits`,
  `sum_mod10`) that a tiny random-init model learns on CPU.
- `dataset`: the `"dataset"` task for user data (JSONL, Parquet, saved HF datasets; key mapping).
- `long_tail`: `copy_digits_long_tail`, copy_digits with long-tailed response lengths (`moe-rl
  bench async`).
- `lookup`: the multi-turn tool task of the agent demo, with its two agents.
- `mixture`: `TaskMixture`, the prompts of `rollout.tasks` drawn by weight, each sample tagged
  with its task's name.
"""

from moe_rl.tasks import dataset, digits, long_tail, lookup, math  # noqa: F401  (registers the built-ins)
from moe_rl.tasks.registry import Prompt, Task, get_reward, make_task, register_reward, register_task, task_names

__all__ = ["Prompt", "Task", "get_reward", "make_task", "register_reward", "register_task", "task_names"]
