"""The export's gathers: tensors of a TP/ETP/EP group brought to one member, and the bytes they move.

Primitives of `parallel.mappings.Mapping.export`: the TP/ETP gathers point-to-point to one member
(`gather_to_first`, `gather_along`: the first, or a dense tensor's diff owner with owner-side
diffs), the EP gather as one collective per parameter (`gather_members`, `gather_payloads` for
owner-side payloads; in two hops by `Rails` across nodes), and a diff owner's hand-over of its
payloads to the first member (`hand_to_first`). `GATHER_BYTES` counts what they move per process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Axis:
    """One parallel axis as seen by this rank."""

    group: Any
    rank: int
    size: int


@dataclass(frozen=True)
class Rails:
    """The EP gather in two hops, so that the members on other nodes reach the root's node through
    several NICs rather than the root's one (`parallel.context.init_ep_rails`). The rails are the
    EP members on the root's node (the root included); each off-node member sends to one rail over
    its NIC (member i of the off-node ones to rail i mod R), then every rail forwards what it holds
    to the root over NVLink."""

    rail: Axis | None  # [this rail, its off-node members] (the rail is rank 0); None: no such group
    node: Axis | None  # [root, the other rails] (the root is rank 0); None off the root's node
    holds: tuple[tuple[int, ...], ...]  # per rail (node rank): the EP ranks it forwards, in order


# TP/ETP gathers go point-to-point to the group's first member (or a dense tensor's diff owner,
# with owner-side diffs), not all-gathers: only one member needs the full tensor, and gloo's
# collectives copy through a flat buffer of their own (2x the tensor at the peak). EP gathers
# (many members, many tensors per parameter) are one `gather` collective per parameter instead
# (`gather_members`).

GATHER_BYTES = {"sent": 0, "received": 0, "received_across_nodes": 0}
"""Bytes this process handed to / got from the export's TP/ETP/EP gathers and the diff owners'
hand-over to the source (`hand_to_first`), both counted where the call is made (`moe-rl bench
sync` reads them per rank); `received_across_nodes`: the part a rail took from other nodes
(`Rails`). A rail counts what it forwards as sent again."""

_ALIGN = 16  # byte offset of each tensor in a flat gather buffer: any dtype views it in place


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    """What goes over the link: FP8 tensors as their bytes (gloo has no float8 types)."""
    return tensor.view(torch.uint8) if tensor.is_floating_point() and tensor.element_size() == 1 else tensor


def gather_to_first(tensor: torch.Tensor, axis: Axis, dst: int = 0) -> torch.Tensor | None:
    """Every member of `axis.group` calls it; member `dst` (the first by default) gets one
    (axis.size, *shape) tensor of all members' tensors, received in place; the others get None."""
    tensor = tensor.contiguous()
    nbytes = tensor.numel() * tensor.element_size()
    if axis.rank != dst:
        dist.send(_wire(tensor), group=axis.group, group_dst=dst)
        GATHER_BYTES["sent"] += nbytes
        return None
    out = tensor.new_empty((axis.size, *tensor.shape))
    out[axis.rank].copy_(tensor)
    for member in range(axis.size):
        if member != dst:
            dist.recv(_wire(out[member]), group=axis.group, group_src=member)
    GATHER_BYTES["received"] += nbytes * (axis.size - 1)
    return out


_DTYPES = (
    torch.uint8,
    torch.int8,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)
_MAX_NDIM = 8


def hand_to_first(tensors: list[torch.Tensor] | None, axis: Axis, src: int, count: int) -> list[torch.Tensor] | None:
    """Member `src`'s `count` tensors (any dtypes and shapes: a diff owner's payloads or HF
    tensors, `Mapping.export`) to member 0 of `axis`, in two point-to-point messages: a table of
    dtypes, shapes and lengths (int64), then one flat buffer. Called by `src` (`tensors`) and
    member 0 (None); member 0 gets them back (views into its buffer, on the device of
    `axis.group`'s backend), `src` None. Memory: one flat buffer of their bytes on each end."""
    assert axis.rank in (0, src) and src != 0, (axis.rank, src)
    table = torch.zeros(count, 3 + _MAX_NDIM, dtype=torch.int64)
    if axis.rank == src:
        assert len(tensors) == count, (len(tensors), count)
        device, at = _group_device(axis), 0
        for row, t in zip(table, tensors):
            row[:3] = torch.tensor([_DTYPES.index(t.dtype), t.dim(), t.numel() * t.element_size()])
            row[3 : 3 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
        flat = torch.empty(sum(_aligned(int(n)) for n in table[:, 2]), dtype=torch.uint8, device=device)
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            flat[at : at + nbytes].copy_(t.detach().contiguous().view(-1).view(torch.uint8))
            at += _aligned(nbytes)
        dist.send(table.to(device), group=axis.group, group_dst=0)
        dist.send(flat, group=axis.group, group_dst=0)
        GATHER_BYTES["sent"] += flat.numel()
        return None
    device = _group_device(axis)
    wire = table.to(device)
    dist.recv(wire, group=axis.group, group_src=src)
    rows = wire.cpu().tolist()
    flat = torch.empty(sum(_aligned(row[2]) for row in rows), dtype=torch.uint8, device=device)
    dist.recv(flat, group=axis.group, group_src=src)
    GATHER_BYTES["received"] += flat.numel()
    out, at = [], 0
    for dtype, ndim, nbytes, *shape in rows:
        out.append(flat[at : at + nbytes].view(_DTYPES[dtype]).view(shape[:ndim]))
        at += _aligned(nbytes)
    return out


def _group_device(axis: Axis) -> torch.device:
    """Where `axis.group`'s tensors live: the current GPU for NCCL, else the host."""
    if dist.get_backend(axis.group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_members(
    tensors: list[torch.Tensor], axis: Axis, rails: Rails | None = None
) -> list[list[torch.Tensor]] | None:
    """One `gather` collective for all of a parameter's tensors (any dtypes, the same shapes on
    every member): every member of `axis.group` calls it; member 0 gets [its own tensors (no copy),
    member 1's, ...], views into one received buffer per member; the others None. With `rails`,
    in two hops (`Rails`): a gather into each rail, then the rails' buffers to member 0.

    Memory: every member packs its tensors into one flat buffer (1x their bytes); member 0 holds
    axis.size of them, a rail its members' too, and gloo adds a transient flat copy of the same
    size (NCCL does not)."""
    offsets, total = [], 0
    for tensor in tensors:
        offsets.append(total)
        total += -(-(tensor.numel() * tensor.element_size()) // _ALIGN) * _ALIGN
    flat = torch.empty(total, dtype=torch.uint8, device=tensors[0].device)
    for tensor, offset in zip(tensors, offsets):
        flat[offset : offset + tensor.numel() * tensor.element_size()].copy_(
            tensor.detach().contiguous().view(-1).view(torch.uint8)
        )
    buffers = _gather_flat(flat, axis) if rails is None else _gather_by_rails(flat, axis.size, rails)
    if buffers is None:
        return None
    members = [list(tensors)]
    for buffer in buffers[1:]:
        members.append(
            [
                buffer[offset : offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                for t, offset in zip(tensors, offsets)
            ]
        )
    return members


def gather_payloads(
    payloads: list[torch.Tensor], axis: Axis, rails: Rails | None = None, device: torch.device | None = None
) -> list[list[torch.Tensor]] | None:
    """`gather_members` for flat uint8 payloads whose sizes differ between members (owner-side
    diffs, `OwnerDiffs`): each member packs a table of its payloads' lengths (int64) and the
    payloads into one flat buffer; the members agree on the largest buffer (one all-reduce of one
    int64 over `axis.group`), pad theirs to it and gather as `gather_members` does (so a member
    sends, and the root receives per member, the largest member's bytes: the padding is measured
    in `GATHER_BYTES`). Member 0 gets [its own payloads, member 1's, ...] (views into each
    member's buffer), the others None. `device`: where the buffer lives (the gather's backend)."""
    if axis.size == 1:
        return [list(payloads)]
    table = _aligned(8 * len(payloads))
    offsets, total = [], table
    for payload in payloads:
        offsets.append(total)
        total += _aligned(payload.numel())
    size = torch.tensor([total], dtype=torch.int64, device=device)
    dist.all_reduce(size, op=dist.ReduceOp.MAX, group=axis.group)
    flat = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    lengths = torch.tensor([payload.numel() for payload in payloads], dtype=torch.int64)
    flat[: 8 * len(payloads)].copy_(lengths.view(torch.uint8))
    for payload, offset in zip(payloads, offsets):
        flat[offset : offset + payload.numel()].copy_(payload)
    buffers = _gather_flat(flat, axis) if rails is None else _gather_by_rails(flat, axis.size, rails)
    if buffers is None:
        return None
    members = [list(payloads)]
    for buffer in buffers[1:]:
        at, got = table, []
        for length in buffer[: 8 * len(payloads)].cpu().view(torch.int64).tolist():
            got.append(buffer[at : at + length])
            at += _aligned(length)
        members.append(got)
    return members


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _gather_flat(flat: torch.Tensor, axis: Axis) -> list[torch.Tensor] | None:
    """Every member's `flat` on member 0 (one collective); None elsewhere."""
    if axis.rank != 0:
        dist.gather(flat, None, group=axis.group, group_dst=0)
        GATHER_BYTES["sent"] += flat.numel()
        return None
    buffers = [flat] + [torch.empty_like(flat) for _ in range(1, axis.size)]
    dist.gather(flat, buffers, group=axis.group, group_dst=0)
    GATHER_BYTES["received"] += flat.numel() * (axis.size - 1)
    return buffers


def _gather_by_rails(flat: torch.Tensor, size: int, rails: Rails) -> list[torch.Tensor] | None:
    """`_gather_flat` in two hops: the off-node members into their rails (across nodes), then
    each rail's buffers to the root (inside its node), received concurrently."""
    held = [flat]
    if rails.rail is not None:
        if rails.rail.rank != 0:
            dist.gather(flat, None, group=rails.rail.group, group_dst=0)
            GATHER_BYTES["sent"] += flat.numel()
            return None
        held += [torch.empty_like(flat) for _ in range(1, rails.rail.size)]
        dist.gather(flat, held, group=rails.rail.group, group_dst=0)
        GATHER_BYTES["received"] += flat.numel() * (rails.rail.size - 1)
        GATHER_BYTES["received_across_nodes"] += flat.numel() * (rails.rail.size - 1)
    if rails.node.rank != 0:
        for work in [dist.isend(buffer, group=rails.node.group, group_dst=0) for buffer in held]:
            work.wait()
        GATHER_BYTES["sent"] += flat.numel() * len(held)
        return None
    buffers: list[torch.Tensor | None] = [None] * size
    for ep_rank, buffer in zip(rails.holds[0], held):
        buffers[ep_rank] = buffer
    works = []
    for rail in range(1, rails.node.size):
        for ep_rank in rails.holds[rail]:
            buffers[ep_rank] = torch.empty_like(flat)
            works.append(dist.irecv(buffers[ep_rank], group=rails.node.group, group_src=rail))
    for work in works:
        work.wait()
    GATHER_BYTES["received"] += flat.numel() * len(works)
    return buffers


def gather_along(tensor: torch.Tensor, axis: Axis, dim: int, dst: int = 0) -> torch.Tensor | None:
    """`gather_to_first`, concatenated along `dim` on member `dst` (one reordering copy when `dim`
    > 0); a size-1 axis returns `tensor` itself."""
    if axis.size == 1:
        return tensor
    out = gather_to_first(tensor, axis, dst)
    if out is None or dim == 0:
        return out if out is None else out.view(-1, *tensor.shape[1:])
    return out.movedim(0, dim).reshape(*tensor.shape[:dim], -1, *tensor.shape[dim + 1 :])
