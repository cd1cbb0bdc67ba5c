"""Per-token log-probabilities from Megatron's vocab-parallel logits."""

from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """log p(target) for logits [B, L, V/tp] split over TP ranks (the output layer's layout).

    Columns at or past `vocab_size` are vocab padding and get -inf, so the distribution is
    exactly the HF model's. Every TP rank must call it (it all-reduces over the TP group);
    all of them get the full [B, L] result.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    local_vocab = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * local_vocab
    columns = torch.arange(start, start + local_vocab, device=logits.device)
    if columns[-1] >= vocab_size:
        logits = logits.masked_fill(columns >= vocab_size, float("-inf"))
    # Megatron's kernel works sequence-major: [L, B, V/tp]
    sequence_major = logits.transpose(0, 1).float().contiguous()
    loss = vocab_parallel_cross_entropy(sequence_major, targets.transpose(0, 1).contiguous())
    return -loss.transpose(0, 1)
