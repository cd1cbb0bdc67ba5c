"""A teacher that solves `copy_digits` (length 1, `max_new_tokens: 2`), made in seconds: a tiny
Qwen3-MoE fitted with plain transformers on the task's ten prompts. Every response token `t` reads
as the digit `t % 10`, so after prompt digit `d` the teacher is fitted to spread its probability
evenly over the 26 tokens that read as `d`, at both response positions (whatever right token came
first): everything it samples scores 1, and a random student already puts a tenth of its mass
there (as for GRPO). It is a real HF checkpoint the embedded engine serves."""

from __future__ import annotations

from pathlib import Path

import torch

from moe_rl.tasks.digits import BOS, DIGIT0, SEP
from tests.tiny_models import QWEN3_MOE_SMALL, hf_config

TEACHER_MODEL = dict(QWEN3_MOE_SMALL, max_position_embeddings=64)
VOCAB = TEACHER_MODEL["vocab_size"]


def copy_teacher(path: Path, seed: int = 1, max_steps: int = 300) -> Path:
    """Fit and save the teacher; raises unless it puts > 99% of its mass on right tokens."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(hf_config(TEACHER_MODEL))
    rows = [(d, t) for d in range(10) for t in range(d, VOCAB, 10)]  # prompt digit, a right first token
    ids = torch.tensor([[BOS, DIGIT0 + d, SEP, t] for d, t in rows])
    right = torch.zeros(len(rows), VOCAB)
    for i, (d, _) in enumerate(rows):
        right[i, d::10] = 1.0
    target = right / right.sum(-1, keepdim=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(max_steps):
        logprobs = model(input_ids=ids).logits[:, 2:4].log_softmax(-1)  # both response positions
        loss = -(target[:, None] * logprobs).sum(-1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        mass = (logprobs.exp() * right[:, None]).sum(-1).min().item()
        if mass > 0.99:
            break
    if mass <= 0.99:
        raise AssertionError(f"the copy teacher did not fit: min mass on right tokens {mass:.3f}")
    model.save_pretrained(path)
    return path
