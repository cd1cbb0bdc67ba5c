"""Context parallelism: which tokens of a sequence each CP rank holds, and gathering them back.

megatron-core's load-balanced split (Megatron-LM's `get_batch_on_this_cp_rank`, Transformer
Engine's `thd_get_partitioned_indices`): every sequence is cut into 2 x cp equal chunks and CP
rank r holds chunks r and 2cp-1-r, in that order. Under causal attention the early chunks are
cheap and the late ones dear, so pairing them gives every rank the same work. A packed (THD)
micro-batch is split segment by segment, each segment's length a multiple of 2 x cp; megatron's
RoPE (`get_pos_emb_on_this_cp_rank`, `_apply_rotary_pos_emb_thd`) assumes exactly this order.

`ContextSplit` holds the split of one micro-batch on one rank. `local` selects this rank's tokens
(no communication). `gather` is collective over the CP group: every CP rank calls it with a tensor
of the same shape and gets the whole sequence in its original order (memory: the whole sequence,
cp times the local tensor). Its backward comes in two kinds:
- `sum_grads=True`: every rank's result fed a computation of its own (attention keys and values
  read by each rank's queries): the gradients are summed over the CP group, then each rank keeps
  its tokens' (an all-reduce of the whole sequence's gradient; gloo has no reduce-scatter);
- `sum_grads=False`: every rank computes the same function of the gathered tensor (the loss over
  whole rows): each rank keeps its tokens' gradient as it is, no communication.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def held_index(segments: list[int], cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """long [sum(segments) / cp]: the positions CP rank `cp_rank` holds of a sequence made of
    `segments` (lengths, each a multiple of 2 x cp_size; one segment for an unpacked sequence):
    per segment, chunk cp_rank then chunk 2cp-1-cp_rank."""
    parts, start = [], 0
    for length in segments:
        if length % (2 * cp_size):
            raise ValueError(f"a segment of {length} tokens does not split into 2 x cp = {2 * cp_size} chunks")
        chunk = length // (2 * cp_size)
        for index in (cp_rank, 2 * cp_size - 1 - cp_rank):
            parts.append(torch.arange(start + index * chunk, start + (index + 1) * chunk, device=device))
        start += length
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=device)


class ContextSplit:
    """One micro-batch's split over the CP group (`group`, this rank `rank` of `size`)."""

    def __init__(self, group, segments: list[int], device=None):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.total = sum(segments)
        self.indices = [held_index(segments, self.size, r, device) for r in range(self.size)]

    @property
    def index(self) -> torch.Tensor:
        """This rank's positions in the whole sequence."""
        return self.indices[self.rank]

    def local(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's tokens of `tensor` (the whole sequence along `dim`)."""
        return tensor.index_select(dim, self.index)

    def gather(self, tensor: torch.Tensor, dim: int, sum_grads: bool) -> torch.Tensor:
        """The whole sequence along `dim` from every rank's `local` part (collective, see module)."""
        return _Gather.apply(tensor, self, dim, sum_grads)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, split: ContextSplit, dim: int, sum_grads: bool) -> torch.Tensor:
        ctx.split, ctx.dim, ctx.sum_grads = split, dim, sum_grads
        moved = tensor.movedim(dim, 0).contiguous()
        parts = [torch.empty_like(moved) for _ in range(split.size)]
        dist.all_gather(parts, moved, group=split.group)
        whole = moved.new_empty((split.total, *moved.shape[1:]))
        for part, index in zip(parts, split.indices):
            whole.index_copy_(0, index.to(whole.device), part)
        return whole.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        split = ctx.split
        grad = grad.movedim(ctx.dim, 0).contiguous()
        if ctx.sum_grads:
            dist.all_reduce(grad, group=split.group)
        mine = grad.index_select(0, split.index.to(grad.device))
        return mine.movedim(0, ctx.dim), None, None, None
