"""A teacher that solves `copy_digits` (length 1, `max_new_tokens: 1`), made in seconds: a tiny
Qwen3-MoE fitted with plain transformers on the task's ten prompts. Every response token `t` reads
as the digit `t % 10`; after prompt digit `d` the teacher is fitted to the distribution that puts
RIGHT_MASS evenly on the 26 tokens that read as `d` and the rest evenly on the others. So it scores
about RIGHT_MASS, a random student already puts a tenth of its mass on right tokens (as GRPO's
start has), and the teacher's opinion of wrong tokens is flat (no noise for the student to chase).
It is a real HF checkpoint the embedded engine serves."""

from __future__ import annotations

from pathlib import Path

import torch

from moe_rl.tasks.digits import BOS, DIGIT0, SEP
from tests.tiny_models import QWEN3_MOE_SMALL, hf_config

TEACHER_MODEL = dict(QWEN3_MOE_SMALL, max_position_embeddings=64)
VOCAB = TEACHER_MODEL["vocab_size"]
RIGHT_MASS = 0.98
"""The teacher's probability of a right token at each response position."""


def copy_teacher(path: Path, seed: int = 1, max_steps: int = 500) -> Path:
    """Fit and save the teacher; raises unless its distributions are within 0.01 (total variation)
    of the target."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(hf_config(TEACHER_MODEL))
    ids = torch.tensor([[BOS, DIGIT0 + d, SEP] for d in range(10)])
    right = torch.zeros(10, VOCAB, dtype=torch.bool)
    for d in range(10):
        right[d, d::10] = True
    target = torch.where(
        right, RIGHT_MASS / right.sum(-1, keepdim=True), (1 - RIGHT_MASS) / (~right).sum(-1, keepdim=True)
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(max_steps):
        logprobs = model(input_ids=ids).logits[:, -1].log_softmax(-1)  # the response's token
        loss = -(target * logprobs).sum(-1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        distance = (logprobs.exp() - target).abs().sum(-1).max().item() / 2
        if distance < 0.01:
            break
    if distance >= 0.01:
        raise AssertionError(f"the copy teacher did not fit: total variation {distance:.3f} from its target")
    model.save_pretrained(path)
    return path
