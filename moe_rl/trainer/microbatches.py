"""Token batches for the trainer: a dict of [B, ...] tensors split into DP shards and microbatches.

Every tensor is indexed by row (sequence). `tokens` [B, S] and `loss_mask` [B, S] are
required; the model predicts tokens[:, 1:] from tokens[:, :-1], and `loss_mask[:, t]` says
whether token t counts (the first column never does). Algorithms add their own per-token
tensors (advantages, rollout logprobs, ...) with the same [B, S] shape.

Two ways to cut a batch into the micro-batches one DP rank runs, both as `Microbatch`es that
carry their row indices:
- by rows (`row_microbatches`, trainer.max_tokens_per_microbatch unset): each DP rank takes a
  contiguous share of the rows, cut into `micro_batch_size` rows at the batch's width;
- by tokens (`budget_microbatches`): rows are packed under the token budget, longest first, each
  micro-batch padded only to its longest row; the micro-batches are balanced over DP ranks by the
  tokens they compute, and every rank runs the same number of them (see `budget_plan`).
With trainer.pack_sequences a token-budget micro-batch also runs packed (`pack_microbatch`): its
rows' real tokens concatenated into one sequence with `cu_seqlens` (THD), no padding between them
(under context parallelism each row is padded to a multiple of 2 x cp). `ModelTokens` maps a
micro-batch's rows to the tokens this rank's model runs (packed, then its CP share) and back.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace

import torch

from parallel.context_parallel import ContextSplit

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


def row_microbatches(batch: Batch, dp_size: int, dp_rank: int, micro_batch_size: int) -> list[Microbatch]:
    """`microbatches` with each one's batch rows (contiguous: the DP rank's share in order)."""
    start = dp_rank * (batch["tokens"].shape[0] // dp_size)
    parts = microbatches(batch, dp_size, dp_rank, micro_batch_size)
    return [
        Microbatch(list(range(start + i * micro_batch_size, start + (i + 1) * micro_batch_size)), part)
        for i, part in enumerate(parts)
    ]


# -- token-budget micro-batches (trainer.max_tokens_per_microbatch) ----------------------------


@dataclass
class Microbatch:
    """One micro-batch the schedule runs: the batch rows it holds (indices into the batch it was
    cut from, so per-row outputs go back in the batch's order) and its tensors. `rows` empty:
    a padding micro-batch (one row of token 0, loss_mask 0) that only keeps the schedule's
    count equal across ranks; the trainer gives its loss no weight. `packing`: set when the
    model runs it packed (`pack_microbatch`); `batch` stays in rows for the loss."""

    rows: list[int]
    batch: Batch
    packing: Packing | None = None

    def to(self, device: torch.device) -> Microbatch:
        """The same micro-batch with its tensors, its packing's too, on `device`."""
        batch = {key: tensor.to(device, non_blocking=True) for key, tensor in self.batch.items()}
        return Microbatch(self.rows, batch, None if self.packing is None else self.packing.to(device))


def row_lengths(batch: Batch) -> list[int]:
    """Each row's real length in tokens: one past its last nonzero token or loss-mask position
    (padding is token 0 with loss_mask 0), at least 2 (one input, one target). The columns past
    it only predict padding, and attention is causal: cutting them changes no trained token."""
    tokens, mask = batch["tokens"], batch["loss_mask"]
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    last = torch.where((tokens != 0) | (mask != 0), positions, -1).amax(dim=1)
    return (last + 1).clamp(min=2).tolist()


def karmarkar_karp(weights: list[int], parts: int) -> list[list[int]]:
    """Partition item indices into `parts` sets of near-equal weight sums (Karmarkar-Karp largest
    differencing, as verl's balance_batch). Deterministic: ties break by index. Sets are listed
    heaviest first, each in increasing index order; a set may be empty when items < parts."""
    # a state: `parts` sets as (sum, indices), heaviest first; the heap pops the largest spread
    heap = []
    for order, index in enumerate(sorted(range(len(weights)), key=lambda i: (-weights[i], i))):
        sets = [(weights[index], [index])] + [(0, []) for _ in range(parts - 1)]
        heapq.heappush(heap, (-weights[index], order, sets))
    counter = len(weights)
    while len(heap) > 1:
        _, _, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        # the heaviest set of one state joins the lightest of the other
        merged = [(a[0] + b[0], a[1] + b[1]) for a, b in zip(first, reversed(second))]
        merged.sort(key=lambda s: -s[0])  # stable: ties keep their order
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), counter, merged))
        counter += 1
    sets = heap[0][2] if heap else [(0, []) for _ in range(parts)]
    return [sorted(indices) for _, indices in sets]


def padded_length(length: int, multiple: int) -> int:
    """The smallest width >= `length` whose model input (width - 1) is a multiple of `multiple`."""
    return length + (-(length - 1)) % multiple


def pack_by_budget(rows: list[int], lengths: list[int], budget: int, multiple: int = 1) -> list[list[int]]:
    """Cut `rows` into micro-batches whose padded tokens (rows x the longest row's padded width)
    fit `budget`: longest rows first, packed greedily; a row longer than the budget goes alone."""
    groups: list[list[int]] = []
    width = 0
    for row in sorted(rows, key=lambda r: (-lengths[r], r)):
        if groups and (len(groups[-1]) + 1) * width <= budget:
            groups[-1].append(row)
        else:
            groups.append([row])
            width = padded_length(lengths[row], multiple)  # the group's first row is its longest
    return groups


def equalize_counts(groups: list[list[int]], count: int, lengths: list[int]) -> list[list[int]]:
    """Split the micro-batch computing the most padded tokens (halves in order, so each half keeps
    its rows sorted) until there are `count`; add empty (padding) micro-batches when no micro-batch
    has two rows left. Each row's computation is unchanged, so gradients are too."""
    groups = [list(group) for group in groups]
    while len(groups) < count:
        splittable = [i for i, group in enumerate(groups) if len(group) > 1]
        if not splittable:
            groups.append([])
            continue
        index = max(splittable, key=lambda i: (len(groups[i]) * lengths[groups[i][0]], -i))
        group = groups[index]
        groups[index : index + 1] = [group[: len(group) // 2], group[len(group) // 2 :]]
    return groups


def budget_plan(lengths: list[int], dp_size: int, budget: int, multiple: int = 1) -> list[list[list[int]]]:
    """Row indices of every DP rank's micro-batches, for rows of `lengths` (`row_lengths`): all
    rows, longest first, packed under the token budget (rows of near-equal length share a
    micro-batch, so little is padded); the micro-batches assigned to DP ranks by Karmarkar-Karp on
    the padded tokens each computes (every rank gets about the same work); then every rank brought
    to the same number of micro-batches (the EP all-to-all and the pipeline schedules need it).
    Packing each rank's share of rows instead leaves neighbours dp_size rows apart in length and
    pads more. Every rank holds the whole batch and computes the same plan, so agreeing on the
    count needs no collective."""
    groups = pack_by_budget(list(range(len(lengths))), lengths, budget, multiple)
    work = [len(group) * padded_length(lengths[group[0]], multiple) for group in groups]
    shares = [[groups[i] for i in share] for share in karmarkar_karp(work, dp_size)]
    count = max(len(share) for share in shares)
    return [equalize_counts(share, count, lengths) for share in shares]


def take_rows(batch: Batch, rows: list[int], multiple: int = 1) -> Microbatch:
    """The micro-batch of `rows`, cut to their longest real length (padded so that the model input
    is a multiple of `multiple`); no rows: one row of padding (token 0, loss_mask 0). `batch`
    must already be padded with `pad_sequence_dim(batch, multiple)`."""
    if not rows:
        width = 1 + multiple
        return Microbatch([], {k: t.new_zeros((1, width, *t.shape[2:])) for k, t in batch.items()})
    lengths = row_lengths(batch)
    width = padded_length(max(lengths[row] for row in rows), multiple)
    assert width <= batch["tokens"].shape[1], "pad the batch with pad_sequence_dim first"
    index = torch.tensor(rows, device=batch["tokens"].device)
    return Microbatch(list(rows), {k: t.index_select(0, index)[:, :width] for k, t in batch.items()})


def budget_microbatches(batch: Batch, dp_size: int, dp_rank: int, budget: int, multiple: int = 1) -> list[Microbatch]:
    """This DP rank's micro-batches under a token budget (see `budget_plan`); `batch` is padded
    with `pad_sequence_dim(batch, multiple)`."""
    plan = budget_plan(row_lengths(batch), dp_size, budget, multiple)
    return [take_rows(batch, rows, multiple) for rows in plan[dp_rank]]


# -- packed sequences (trainer.pack_sequences) ---------------------------------------------------


@dataclass
class Packing:
    """Where a micro-batch's model inputs lie in its packed sequence [1, T] (THD).

    Row r of the micro-batch [rows, W] contributes its first `lengths[r]` = real length - 1 inputs
    (the columns a trained prediction can depend on, see `row_lengths`), rows in order. Each row is
    a segment of its own, padded at its end to the segment multiple (2 x cp under context
    parallelism, where every segment is split into 2 x cp chunks; else 1: no gap); a tail of
    padding (token 0, loss_mask 0) brings T to the sequence multiple and is a segment of its own,
    so every position attends inside its segment. Tensors on the input side ([rows, W - 1, ...],
    column t = token t, or the prediction made from it) go in with `pack` and come back with
    `unpack`; columns past a row's inputs come back 0."""

    lengths: list[int]
    """Model inputs of each row (its real length - 1)."""
    width: int
    """Columns of the row form's input side (W - 1)."""
    total: int
    """T: the packed length, the padded segments' sum padded to the multiple."""
    index: torch.Tensor
    """long [sum(lengths)]: the flat row-form position r * width + t of each packed input."""
    slots: torch.Tensor
    """long [sum(lengths)]: where each of those inputs lies in the packed sequence."""
    cu_seqlens: torch.Tensor
    """int32 [segments + 1]: segment starts, the rows then the padding tail (if any)."""
    positions: torch.Tensor
    """long [1, T]: position ids, from 0 in each segment (RoPE itself reads cu_seqlens)."""
    max_seqlen: int

    def to(self, device: torch.device) -> Packing:
        """The same packing with its tensors on `device`, beside the micro-batch it indexes."""
        moved = {name: getattr(self, name).to(device) for name in ("index", "slots", "cu_seqlens", "positions")}
        return replace(self, **moved)

    @property
    def segments(self) -> list[int]:
        """The packed segments' lengths (padded rows, then the tail)."""
        return self.cu_seqlens.diff().tolist()

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        """[rows, width, ...] (input side) -> [1, T, ...], the padding zero."""
        flat = tensor.reshape(-1, *tensor.shape[2:]).index_select(0, self.index)
        return flat.new_zeros((self.total, *flat.shape[1:])).index_copy(0, self.slots, flat)[None]

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """[1, T, ...] -> [rows, width, ...], 0 past each row's inputs (differentiable)."""
        values = packed[0].index_select(0, self.slots)
        rows = len(self.lengths)
        out = values.new_zeros((rows * self.width, *values.shape[1:])).index_copy(0, self.index, values)
        return out.reshape(rows, self.width, *values.shape[1:])

    def packed_seq_params(self):
        """megatron-core's PackedSeqParams for these segments (self-attention: q and kv alike). The
        boundaries are the padded segments': under CP each splits into 2 x cp chunks, and a row's
        padding comes after its tokens, which causal attention never lets them read."""
        # heavy: megatron-core, loaded only where a model is built (after parallel.cpu_compat.apply)
        from megatron.core.packed_seq_params import PackedSeqParams

        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=self.cu_seqlens,
            cu_seqlens_kv=self.cu_seqlens,
            max_seqlen_q=self.max_seqlen,
            max_seqlen_kv=self.max_seqlen,
        )


def pack_microbatch(part: Microbatch, multiple: int = 1, segment_multiple: int = 1) -> Microbatch:
    """`part` with its `Packing`: its rows' inputs concatenated into one sequence, each row padded
    to a multiple of `segment_multiple` (2 x cp), the whole to a multiple of `multiple` (the
    sequence multiple, itself a multiple of `segment_multiple`). A padding micro-batch packs its one
    row like any."""
    tokens = part.batch["tokens"]
    width = tokens.shape[1] - 1
    lengths = [min(length - 1, width) for length in row_lengths(part.batch)]
    padded = [length + (-length) % segment_multiple for length in lengths]
    used = sum(padded)
    total = used + (-used) % multiple
    segments = padded + ([total - used] if total > used else [])
    starts = [sum(padded[:row]) for row in range(len(padded))]
    cu_seqlens = torch.tensor([0, *segments], device=tokens.device).cumsum(0).to(torch.int32)
    index = torch.cat([row * width + torch.arange(length, device=tokens.device) for row, length in enumerate(lengths)])
    slots = torch.cat([start + torch.arange(length, device=tokens.device) for start, length in zip(starts, lengths)])
    positions = torch.cat([torch.arange(length, device=tokens.device) for length in segments])[None]
    packing = Packing(lengths, width, total, index, slots, cu_seqlens, positions, max(segments))
    return Microbatch(part.rows, part.batch, packing)


# -- the tokens this rank's model runs (packing, context parallelism) ---------------------------


@dataclass
class ModelTokens:
    """How a micro-batch's input-side rows [rows, W - 1, ...] map to the tokens this rank's model
    runs, and back: packed into [1, T, ...] when the micro-batch has a `Packing`, then this rank's
    context-parallel share (`split`, chunks r and 2cp-1-r of each segment) when cp > 1."""

    packing: Packing | None
    split: ContextSplit | None

    @classmethod
    def of(cls, part: Microbatch, cp_group=None) -> ModelTokens:
        """The view of `part` on this rank; `cp_group`: the CP group when cp > 1."""
        if cp_group is None:
            return cls(part.packing, None)
        tokens = part.batch["tokens"]
        segments = part.packing.segments if part.packing is not None else [tokens.shape[1] - 1]
        return cls(part.packing, ContextSplit(cp_group, segments, tokens.device))

    def to_model(self, tensor: torch.Tensor) -> torch.Tensor:
        """[rows, W - 1, ...] -> [rows (1 packed), the tokens this rank runs, ...] (no communication)."""
        if self.packing is not None:
            tensor = self.packing.pack(tensor)
        return tensor if self.split is None else self.split.local(tensor, dim=1)

    def positions(self, tokens: torch.Tensor) -> torch.Tensor:
        """Position ids of the tokens this rank runs, for a micro-batch of `tokens` [rows, W]: from 0 in
        each row (each packed segment)."""
        if self.packing is not None:
            positions = self.packing.positions
        else:
            positions = torch.arange(tokens.shape[1] - 1, device=tokens.device).expand(tokens.shape[0], -1)
        return positions if self.split is None else self.split.local(positions, dim=1)

    def to_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """A per-token output of the model [rows (1 packed), this rank's tokens, ...] -> [rows, W - 1, ...]
        in the batch's token order (differentiable). Under CP it is collective over the CP group (every
        rank gets the whole rows) and every rank must compute the same function of the result: each
        keeps the gradient of its own tokens (`ContextSplit.gather`, sum_grads=False)."""
        if self.split is not None:
            tensor = self.split.gather(tensor, dim=1, sum_grads=False)
        return tensor if self.packing is None else self.packing.unpack(tensor)
