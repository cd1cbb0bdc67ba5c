"""Mapping kinds: how one Megatron parameter relates to its HF checkpoint tensor(s).

A bridge's table is a tuple of these. Each kind owns, once, the parallel logic of its
parameter class:
- TP / ETP: `gather` rebuilds the full Megatron tensor from the shards of a tensor-parallel
  group, `read_shard` reads only this rank's slice from the HF file;
- EP: an `expert=True` mapping uses the expert-tensor-parallel group instead of TP, and
  all-gathers over the expert-parallel group, renaming local expert j of EP rank r to the
  global expert j + r * experts_per_rank;
- PP: Megatron numbers layers locally per stage; HF names use `layer_offset + local`.
- MTP: the multi-token-prediction block's layers (`mtp.layers.{k}`, on the last stage) are HF
  layers `num_hidden_layers + k` (`layer_base`), whatever the stage offset (`Mapping.for_mtp`).
Patterns use `*` for the layer index, then (expert mappings) the expert index. The gathers
themselves (and the bytes they move): `parallel.gathers`.
"""

from __future__ import annotations

import copy
import re
import warnings
from dataclasses import dataclass
from importlib.metadata import version
from typing import Protocol

import torch

from parallel.fp8 import SCALE_SUFFIX, BlockFP8
from parallel.gathers import Axis, Rails, gather_along, gather_members, gather_payloads, hand_to_first


@dataclass(frozen=True)
class ParallelContext:
    """Where this rank sits in the Megatron world, and the sizes the mappings need."""

    tp: Axis
    etp: Axis
    ep: Axis
    pp_rank: int
    pp_size: int
    layer_offset: int  # global index of this stage's first layer
    num_local_experts: int
    vocab_size: int  # the HF (unpadded) vocab size
    in_source_replica: bool = True  # DP rank 0 and CP rank 0: the replica the export gathers from
    in_expert_source_replica: bool = True  # expert-DP rank 0: likewise for expert parameters
    ep_rails: Rails | None = None  # the EP gather's two hops when the EP group spans nodes


class ShardReader(Protocol):
    def names(self) -> set[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The HF tensor `name`, or its rows/columns [start, stop) along `dim`."""


class OwnerDiffs(Protocol):
    """Owner-side diffs (`sync.owner.DiffOwner` implements it): what an expert owner does with its
    HF tensors (FP8 quantized, scales included) before the EP gather, and a dense tensor's diff
    owner (a TP member, `Mapping.export`'s `diff_owner`) before handing it to the TP group's first
    member."""

    @property
    def encodes(self) -> bool:
        """This update's tensors travel as payloads (the same on every trainer rank)."""

    def encode(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The flat uint8 payload, on `tensor`'s device, that stands for `tensor` (kept for the next update)."""

    def keep(self, name: str, tensor: torch.Tensor) -> None:
        """`tensor` goes as it is (an anchor): keep it."""

    def received(self, names: list[str]) -> None:
        """On the gathering rank (the stage source): the names its owners encoded or kept, which
        it passes on unchanged."""


def _through(owner: OwnerDiffs | None, names: list[str], tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """`tensors` as they leave their owner: its payloads when it encodes, else the tensors
    themselves, kept (as they are with no owner)."""
    if owner is not None and owner.encodes:
        return [owner.encode(name, tensor) for name, tensor in zip(names, tensors)]
    for name, tensor in zip(names, tensors) if owner is not None else ():
        owner.keep(name, tensor)
    return tensors


def _pattern(template: str) -> re.Pattern:
    return re.compile("^" + re.escape(template).replace(r"\*", r"(\d+)") + "$")


def _fill(template: str, indices: tuple[int, ...]) -> str:
    for index in indices:
        template = template.replace("*", str(index), 1)
    return template


def _mtp_inner_layer() -> str:
    """The attribute megatron-core gives the MTP block's decoder layer: `transformer_layer` up to
    0.16, `mtp_model_layer` from 0.17 (checked in the 0.17.0, 0.18.0 and 0.19.2 wheels). Read from
    the installed distribution's version, without importing megatron-core."""
    major, minor = (int(part) for part in version("megatron-core").split(".")[:2])
    return "transformer_layer" if (major, minor) < (0, 17) else "mtp_model_layer"


MTP_INNER_LAYER = _mtp_inner_layer()


class Mapping:
    """Base kind: a Megatron name pattern, HF name patterns, and export/import of one tensor.

    Subclasses implement `gather` (collective over a TP/ETP axis), `to_hf` (full Megatron
    tensor -> HF tensors, in `hf` order) and `read_shard` (HF file -> this rank's shard).
    """

    def __init__(
        self, megatron: str, *hf: str, expert: bool = False, export: bool = True, layer_base: int | None = None
    ):
        self.megatron, self.hf, self.expert, self.exported = megatron, hf, expert, export
        self.layer_base = layer_base  # HF index of Megatron layer 0 (MTP layers); None: the stage's offset
        self.regex = _pattern(megatron)

    def for_mtp(self, first_layer: int) -> "Mapping":
        """This decoder-layer mapping for the MTP block's transformer layers: Megatron
        `mtp.layers.{k}.{MTP_INNER_LAYER}.*`, HF layer `first_layer + k`."""
        if not self.megatron.startswith("decoder.layers.*."):
            raise ValueError(f"{self}: only decoder-layer mappings have an MTP counterpart")
        clone = copy.copy(self)
        clone.megatron = self.megatron.replace("decoder.layers.*.", f"mtp.layers.*.{MTP_INNER_LAYER}.", 1)
        clone.regex, clone.layer_base = _pattern(clone.megatron), first_layer
        return clone

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.megatron!r} <-> {', '.join(self.hf)})"

    def match(self, name: str) -> tuple[int, ...] | None:
        found = self.regex.match(name)
        return tuple(int(g) for g in found.groups()) if found else None

    def hf_names(self, ctx: ParallelContext, indices: tuple[int, ...], ep_rank: int | None = None) -> list[str]:
        """HF names for the Megatron parameter at local `indices` (layer[, expert])."""
        indices = list(indices)
        if indices:
            indices[0] += ctx.layer_offset if self.layer_base is None else self.layer_base
        if self.expert:
            rank = ctx.ep.rank if ep_rank is None else ep_rank
            indices[1] += rank * ctx.num_local_experts
        return [_fill(name, tuple(indices)) for name in self.hf]

    def axis(self, ctx: ParallelContext) -> Axis:
        return ctx.etp if self.expert else ctx.tp

    # -- export: collective over the TP/ETP group, then (experts) the EP group -------------
    shard_block_dim: int | None = None
    """The weight dim (-2 rows, -1 cols) along which this kind's TP shards concatenate into the
    HF tensor unchanged; None where `to_hf` reorders rows (QKV, rope rows), so FP8 blocks can
    only be formed after the gather."""
    halves = 1
    """Runs of rows per TP shard (GatedColumn: [gate_r; up_r])."""

    def export(
        self,
        local: torch.Tensor,
        ctx: ParallelContext,
        indices: tuple[int, ...],
        fp8: BlockFP8 | None = None,
        owner: OwnerDiffs | None = None,
        diff_owner: int = 0,
    ) -> list[tuple[str, torch.Tensor]]:
        """All ranks of the param's TP/ETP group call it in lockstep, then (experts) the ETP
        rank-0 members of the EP group; the first member of each gets every HF tensor of the
        param (experts: of all EP ranks), the others []. Memory: the full tensors, there.

        `fp8`: decoder linear weights (`BlockFP8.quantizes`) leave as FP8 blocks + `*_scale_inv`,
        quantized where the weight lives, before any link: each TP shard on its own device when
        the shard is whole blocks (`shard_block_dim`), else right after the TP gather, on the
        gathering rank; the EP gather and everything after it carry FP8 bytes. The bytes equal
        `fp8.quantize_stream` of the full-precision export.

        `owner` (owner-side diffs, `sync.owner`): an expert owner's tensors go through it just
        before the EP gather; when it `encodes`, the gather carries its payloads
        (`gather_payloads`) and so do the results. A non-expert param is gathered to its
        `diff_owner` (a TP member) instead of member 0; that member converts it, passes its HF
        tensors through its `owner` and hands the payloads (or, not encoding, the tensors) to
        member 0 (`hand_to_first`), which returns them. Without `owner`, `diff_owner` is ignored."""
        axis = self.axis(ctx)
        names = self.hf_names(ctx, indices)
        targets = fp8 is not None and all(fp8.quantizes(name, local.ndim) for name in names)
        dst = diff_owner if owner is not None and not self.expert else 0
        pieces: list[tuple[int, str, torch.Tensor]] = []  # (HF name index, suffix, tensor)
        if targets and self._whole_blocks(local, axis, fp8):
            quantized, scale_inv = (self.gather(t, axis, dst) for t in fp8.quantize(local.detach()))
            if axis.rank == dst:
                for i, (q, s) in enumerate(zip(self.to_hf(quantized, ctx), self.to_hf(scale_inv, ctx))):
                    pieces += [(i, "", q), (i, SCALE_SUFFIX, s)]
        else:
            full = self.gather(local.detach(), axis, dst)
            if axis.rank == dst:
                for i, tensor in enumerate(self.to_hf(full, ctx)):
                    pieces += zip([i, i], ["", SCALE_SUFFIX], fp8.quantize(tensor)) if targets else [(i, "", tensor)]
        if not self.expert:
            labels = [names[i] + suffix for i in range(len(names)) for suffix in ("", SCALE_SUFFIX)[: 1 + targets]]
            return self._diffed(labels, [tensor for _, _, tensor in pieces], axis, dst, owner)
        if axis.rank != 0:
            return []
        sent = _through(owner, [names[i] + suffix for i, suffix, _ in pieces], [t for _, _, t in pieces])
        if owner is not None and owner.encodes:
            members = gather_payloads(sent, ctx.ep, ctx.ep_rails, device=local.device)
        else:
            members = gather_members(sent, ctx.ep, ctx.ep_rails)
        if members is None:
            return []
        out: list[tuple[str, torch.Tensor]] = []
        for ep_rank, tensors in enumerate(members):
            names = self.hf_names(ctx, indices, ep_rank)
            out.extend((names[i] + suffix, tensor) for (i, suffix, _), tensor in zip(pieces, tensors))
        if owner is not None:
            owner.received([name for name, _ in out])
        return out

    @staticmethod
    def _diffed(
        names: list[str], tensors: list[torch.Tensor], axis: Axis, dst: int, owner: OwnerDiffs | None
    ) -> list[tuple[str, torch.Tensor]]:
        """A non-expert param's HF tensors (`tensors`, on member `dst` only) as member 0 returns
        them: through `dst`'s `owner` (payloads when it encodes, else kept as they go), handed to
        member 0 when `dst` is another member; [] on the others."""
        if axis.rank == dst and owner is not None:
            assert len(tensors) == len(names), (names, len(tensors))
            tensors = _through(owner, names, tensors)
        if dst != 0 and axis.rank in (0, dst):
            tensors = hand_to_first(tensors if axis.rank == dst else None, axis, dst, len(names))
        if axis.rank != 0:
            return []
        if owner is not None:
            owner.received(names)
        return list(zip(names, tensors))

    def _whole_blocks(self, local: torch.Tensor, axis: Axis, fp8: BlockFP8) -> bool:
        """True when each TP shard quantizes alone into the blocks of the gathered weight."""
        if self.shard_block_dim is None or axis.size == 1 or local.ndim != 2:
            return False
        block = fp8.rows if self.shard_block_dim == -2 else fp8.cols
        return (local.shape[self.shard_block_dim] // self.halves) % block == 0

    # -- import: no collective; reads only this rank's slices ------------------------------
    def load(
        self, reader: ShardReader, ctx: ParallelContext, indices: tuple[int, ...], local_shape: torch.Size
    ) -> torch.Tensor:
        shard = self.read_shard(reader, self.hf_names(ctx, indices), self.axis(ctx), local_shape)
        if tuple(shard.shape) != tuple(local_shape):
            raise ValueError(
                f"{self}: HF tensors give a shard of shape {tuple(shard.shape)} but the Megatron "
                f"parameter is {tuple(local_shape)}: the HF config does not match the checkpoint"
            )
        return shard

    def gather(self, local: torch.Tensor, axis: Axis, dst: int = 0) -> torch.Tensor | None:
        """The full Megatron tensor on `axis` member `dst`, None on the others (all call it; a
        replicated tensor is whole everywhere)."""
        raise NotImplementedError

    def to_hf(self, full: torch.Tensor, ctx: ParallelContext) -> list[torch.Tensor]:
        return [full]

    def read_shard(self, reader: ShardReader, names: list[str], axis: Axis, local_shape: torch.Size) -> torch.Tensor:
        raise NotImplementedError


class Replicated(Mapping):
    """Same tensor on every rank (norms, router)."""

    def gather(self, local, axis, dst=0):
        return local

    def read_shard(self, reader, names, axis, local_shape):
        return reader.read(names[0])


class ColumnParallel(Mapping):
    """Split along dim 0 (output features) over TP (ETP for experts)."""

    dim = 0
    shard_block_dim = -2

    def gather(self, local, axis, dst=0):
        return gather_along(local, axis, self.dim, dst)

    def read_shard(self, reader, names, axis, local_shape):
        n = reader.shape(names[0])[self.dim] // axis.size
        return reader.read(names[0], self.dim, axis.rank * n, (axis.rank + 1) * n)


class RowParallel(ColumnParallel):
    """Split along dim 1 (input features) over TP (ETP for experts)."""

    dim = 1
    shard_block_dim = -1


class VocabParallel(ColumnParallel):
    """Embedding / output layer: rows split over TP, padded to Megatron's padded vocab.
    Padded rows are zero after import and dropped on export."""

    shard_block_dim = None  # never FP8 (embedding, head)

    def to_hf(self, full, ctx):
        return [full[: ctx.vocab_size]]

    def read_shard(self, reader, names, axis, local_shape):
        rows = local_shape[0]
        start = axis.rank * rows
        stop = min(start + rows, reader.shape(names[0])[0])
        part = reader.read(names[0], 0, start, max(start, stop))
        shard = part.new_zeros(local_shape)
        shard[: part.shape[0]] = part
        return shard


class SharedWithMTP(VocabParallel):
    """The embedding or the output layer when the model has MTP layers, which share both (Megatron
    keeps a tied copy of the embedding on the MTP stage). DeepSeek's checkpoints store a copy per
    MTP layer (`model.layers.{N}.embed_tokens.weight`, `model.layers.{N}.shared_head.head.weight`):
    import reads the main tensor on every stage (a copy that differs is warned about, since one
    tensor cannot hold both) and export writes the main tensor from its own stage (`main_stage`:
    0 for the embedding, -1 for the output layer) and the copies from the last stage, where the
    MTP block lives. HF names: (main, *copies)."""

    def __init__(self, megatron: str, main: str, *copies: str, main_stage: int):
        super().__init__(megatron, main, *copies)
        self.main_stage = main_stage

    def hf_names(self, ctx, indices, ep_rank=None):
        main_here = ctx.pp_rank == (self.main_stage % ctx.pp_size)
        return [self.hf[0]] * main_here + list(self.hf[1:]) * (ctx.pp_rank == ctx.pp_size - 1)

    def to_hf(self, full, ctx):
        names = self.hf_names(ctx, ())
        trimmed = super().to_hf(full, ctx)[0]
        return [trimmed] + [trimmed.clone() for _ in names[1:]]  # safetensors refuses shared storage

    def load(self, reader, ctx, indices, local_shape):
        shard = self.read_shard(reader, [self.hf[0]], self.axis(ctx), local_shape)
        for name in set(self.hf_names(ctx, indices)) & reader.names() - {self.hf[0]}:
            if not torch.equal(self.read_shard(reader, [name], self.axis(ctx), local_shape), shard):
                warnings.warn(f"{name} differs from {self.hf[0]}: Megatron's MTP block shares one tensor, the latter")
        return shard


class GatedColumn(Mapping):
    """SwiGLU fc1 = [gate; up]. Each TP rank holds [gate_r; up_r], so the halves are gathered
    separately. HF names: (gate, up)."""

    shard_block_dim, halves = -2, 2

    def gather(self, local, axis, dst=0):
        if axis.size == 1:
            return local
        # [rank][gate_r; up_r] -> [gate_0 .. gate_n; up_0 .. up_n]
        halves = gather_along(local.view(2, -1, *local.shape[1:]), axis, dim=1, dst=dst)
        return None if halves is None else halves.reshape(-1, *local.shape[1:])

    def to_hf(self, full, ctx):
        return list(full.chunk(2, dim=0))

    def read_shard(self, reader, names, axis, local_shape):
        n = reader.shape(names[0])[0] // axis.size
        return torch.cat([reader.read(name, 0, axis.rank * n, (axis.rank + 1) * n) for name in names])


class QKV(ColumnParallel):
    """Fused attention input projection, laid out per query group as
    [q (heads_per_group * head_dim); k (head_dim); v (head_dim)] and split over TP by groups.
    HF names: (q, k, v)."""

    shard_block_dim = None  # to_hf regroups rows across shards

    def __init__(self, megatron: str, q: str, k: str, v: str, *, num_query_groups: int, head_dim: int):
        super().__init__(megatron, q, k, v)
        self.groups, self.head_dim = num_query_groups, head_dim

    def to_hf(self, full, ctx):
        per_group = full.shape[0] // self.groups
        rest = full.shape[1:]  # (hidden,) for the weight, () for the bias
        grouped = full.reshape(self.groups, per_group, *rest)
        q, k, v = grouped.split([per_group - 2 * self.head_dim, self.head_dim, self.head_dim], dim=1)
        return [t.reshape(-1, *rest).contiguous() for t in (q, k, v)]

    def read_shard(self, reader, names, axis, local_shape):
        groups = self.groups // axis.size
        q_rows = reader.shape(names[0])[0] // self.groups
        first = axis.rank * groups
        q = reader.read(names[0], 0, first * q_rows, (first + groups) * q_rows)
        k, v = (reader.read(n, 0, first * self.head_dim, (first + groups) * self.head_dim) for n in names[1:])
        rest = q.shape[1:]
        parts = [t.reshape(groups, -1, *rest) for t in (q, k, v)]
        return torch.cat(parts, dim=1).reshape(-1, *rest)


class RopeRows(ColumnParallel):
    """A projection whose rows come in blocks (one per head, or one latent block) ending in
    `rope` rotary rows; split over TP along rows (`split=False`: replicated, as TE's duplicated
    linear). Megatron's MLA rotates interleaved pairs (x0,x1 | x2,x3 ...: it de-interleaves to
    [even; odd] before rotating halves), the layout of DeepSeek's checkpoints
    (`rope_interleave=true`). A checkpoint with `rope_interleave=false` rotates halves directly,
    so its rotary rows are re-interleaved on import (HF row i -> Megatron row [even; odd][i]),
    and export undoes it; q.k only sees rows after rotation, so logits are unchanged."""

    shard_block_dim = None  # to_hf may reorder rotary rows

    def __init__(self, megatron: str, hf: str, *, block: int, rope: int, hf_interleaved: bool, split: bool = True):
        super().__init__(megatron, hf)
        self.block, self.rope, self.split = block, rope, split
        halves = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
        self.hf_order = None if hf_interleaved else halves  # Megatron rows -> HF order

    def _reorder(self, rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        blocks = rows.reshape(-1, self.block, *rows.shape[1:])
        rope = blocks[:, self.block - self.rope :]
        return torch.cat([blocks[:, : self.block - self.rope], rope[:, order]], dim=1).reshape(rows.shape)

    def gather(self, local, axis, dst=0):
        return super().gather(local, axis, dst) if self.split else local

    def to_hf(self, full, ctx):
        return [full if self.hf_order is None else self._reorder(full, self.hf_order)]

    def read_shard(self, reader, names, axis, local_shape):
        rows = reader.shape(names[0])[0]
        n = rows // axis.size if self.split else rows
        start = axis.rank * n if self.split else 0
        first, last = start // self.block, -(-(start + n) // self.block)  # whole blocks covering the shard
        part = reader.read(names[0], 0, first * self.block, last * self.block)
        if self.hf_order is not None:
            part = self._reorder(part, torch.argsort(self.hf_order))
        offset = start - first * self.block
        return part[offset : offset + n]


def resolve(table: tuple[Mapping, ...], name: str) -> tuple[Mapping, tuple[int, ...]]:
    """The mapping of Megatron parameter `name` and its indices; ValueError if none matches."""
    for mapping in table:
        indices = mapping.match(name)
        if indices is not None:
            return mapping, indices
    raise ValueError(f"Megatron parameter {name!r} has no mapping in this bridge's table: add one")
