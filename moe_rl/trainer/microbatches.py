"""Token batches for the trainer: a dict of [B, ...] tensors split into DP shards and microbatches.

Every tensor is indexed by row (sequence). `tokens` [B, S] and `loss_mask` [B, S] are
required; the model predicts tokens[:, 1:] from tokens[:, :-1], and `loss_mask[:, t]` says
whether token t counts (the first column never does). Algorithms add their own per-token
tensors (advantages, rollout logprobs, ...) with the same [B, S] shape.
"""

from __future__ import annotations

import torch

Batch = dict[str, torch.Tensor]


def check_batch(batch: Batch) -> None:
    for key in ("tokens", "loss_mask"):
        if key not in batch:
            raise ValueError(f"batch lacks {key!r}: give tokens [B, S] and loss_mask [B, S]")
    rows = batch["tokens"].shape[0]
    for key, tensor in batch.items():
        if tensor.shape[0] != rows:
            raise ValueError(f"batch[{key!r}] has {tensor.shape[0]} rows, tokens has {rows}")


def pad_sequence_dim(batch: Batch, multiple: int) -> Batch:
    """Pad every [B, S, ...] tensor along S so that S - 1 (the model input length) is a multiple
    of `multiple` (sequence parallel splits the sequence over TP). Padding is masked out."""
    seq = batch["tokens"].shape[1]
    extra = (-(seq - 1)) % multiple
    if extra == 0:
        return batch
    padded = {}
    for key, tensor in batch.items():
        pad = tensor.new_zeros((tensor.shape[0], extra, *tensor.shape[2:]))
        padded[key] = torch.cat([tensor, pad], dim=1)
    return padded


def split_rows(batch: Batch, parts: int, index: int) -> Batch:
    rows = batch["tokens"].shape[0]
    if rows % parts:
        raise ValueError(f"batch of {rows} sequences cannot be split into {parts} equal parts")
    size = rows // parts
    return {key: tensor[index * size : (index + 1) * size] for key, tensor in batch.items()}


def microbatches(batch: Batch, dp_size: int, dp_rank: int, micro_batch_size: int) -> list[Batch]:
    """This DP rank's share of a global batch, cut into microbatches of `micro_batch_size`."""
    shard = split_rows(batch, dp_size, dp_rank)
    rows = shard["tokens"].shape[0]
    if rows % micro_batch_size:
        raise ValueError(f"{rows} sequences per DP rank are not a multiple of micro_batch_size={micro_batch_size}")
    return [split_rows(shard, rows // micro_batch_size, i) for i in range(rows // micro_batch_size)]
