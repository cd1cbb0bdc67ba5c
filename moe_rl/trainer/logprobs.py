"""Per-token log-probabilities and entropies from Megatron's vocab-parallel logits.

Logits arrive as [B, L, V/tp], split over the TP ranks like the output layer. Columns at or past
`vocab_size` are vocab padding and get -inf, so the distribution is exactly the HF model's.
Every TP rank must call these functions (they all-reduce over the TP group); all of them get
the full [B, L] result.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _without_vocab_padding(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    # heavy: megatron-core, loaded only where a model is built (after parallel.cpu_compat.apply)
    from megatron.core import parallel_state

    local_vocab = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * local_vocab
    columns = torch.arange(start, start + local_vocab, device=logits.device)
    if columns[-1] >= vocab_size:
        logits = logits.masked_fill(columns >= vocab_size, float("-inf"))
    return logits


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """log p(target) [B, L], differentiable."""
    # heavy: megatron-core, loaded only where a model is built (after parallel.cpu_compat.apply)
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = _without_vocab_padding(logits, vocab_size)
    # Megatron's kernel works sequence-major: [L, B, V/tp]
    sequence_major = logits.transpose(0, 1).float().contiguous()
    loss = vocab_parallel_cross_entropy(sequence_major, targets.transpose(0, 1).contiguous())
    return -loss.transpose(0, 1)


@torch.no_grad()
def token_entropy(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Entropy of each next-token distribution [B, L] (a metric: no gradient)."""
    # heavy: megatron-core, loaded only where a model is built (after parallel.cpu_compat.apply)
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    logits = _without_vocab_padding(logits.detach().float(), vocab_size)
    peak = logits.max(dim=-1, keepdim=True).values
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - peak
    weights = shifted.exp()
    weighted = torch.where(weights > 0, weights * shifted, torch.zeros_like(shifted))  # 0 * -inf
    sums = torch.stack([weights.sum(-1), weighted.sum(-1)])
    dist.all_reduce(sums, group=group)
    partition, expected_shift = sums[0], sums[1] / sums[0]
    return partition.log() - expected_shift
