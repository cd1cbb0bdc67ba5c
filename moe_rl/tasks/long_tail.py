"""`copy_digits_long_tail`: copy_digits with long-tailed response lengths (for `moe-rl bench async`).

A response ends at any of `num_stop_tokens` stop tokens (ids 256 - num_stop_tokens .. 255, the
top of a 256-token vocabulary) or at the budget. A near-uniform policy stops with probability
num_stop_tokens / vocab per token, so lengths are geometric (mean ~ vocab / num_stop_tokens),
capped by `max_new_tokens`: most responses are short, a few run to the budget. That tail is what
makes drain-before-sync wait and partial rollouts pay off.
"""

from __future__ import annotations

from moe_rl.tasks.digits import CopyDigits
from moe_rl.tasks.registry import register_task


@register_task("copy_digits_long_tail")
class CopyDigitsLongTail(CopyDigits):
    def __init__(self, length: int = 1, num_stop_tokens: int = 16, vocab_size: int = 256):
        super().__init__(length)
        if not 1 <= num_stop_tokens < vocab_size - 20:
            raise ValueError(f"rollout.task_options.num_stop_tokens={num_stop_tokens}: use 1..{vocab_size - 21}")
        self.stop_token_ids = list(range(vocab_size - num_stop_tokens, vocab_size))
