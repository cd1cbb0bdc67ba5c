"""Delta sync into SGLang: a custom weight loader that applies `sync.delta` payloads in place, on each
TP rank's live parameters, wherever SGLang's own loader put each HF tensor's elements.

SGLang 0.5.23 runs a custom loader on one route only: `/update_weights_from_tensor` with
`load_format` naming an import path the server registered with `--custom-weight-loader`
(`WeightUpdater.update_weights_from_tensor` calls `loader(model, named_tensors)` on every TP rank;
this function's path is `sync.delta.SGLANG_LOADER`).
Here each named tensor is the `sync.delta` payload of the HF tensor of that name (SUM64-hashed),
and a last call names `sync.delta.SGLANG_COMMIT` with the version the engine is about to serve.

Where the elements live. SGLang fuses (qkv, gate_up), slices for TP and stacks experts, so an HF
element sits at some flat position of some parameter of the rank, or on another rank. The loader
learns this once per tensor, the first time it arrives (as a dense payload: an anchor), by loading
tags through the model's own `load_weights`:
1. the tensor's layer's parameters are saved and filled with NaN;
2. pass k loads every element as digit k of its index (base 2^(mantissa bits + 1), so the digit is
   exact in the tensor's dtype); a parameter element that is no longer NaN holds a tensor element,
   and its digits say which one;
3. the parameters are restored and the real values loaded with `load_weights`; the plan must find
   them bit for bit where it says they are, else the tensor is refused (a loader that transforms
   values, e.g. quantizes on load, cannot take deltas in place).
A plan is kept as runs (offset in the tensor, offset in the parameter, length): a TP slice of rows
is one run, a slice of columns one run per row. It costs about len(digits) + 2 loads of the anchor
once, and a few int64 per run.

Applying a bucket (every TP rank runs the same calls in the same order; SGLang fans requests out):
- each rank checks the headers and the base versions against the versions it holds, and the ranks
  agree (a MAX all-reduce over SGLang's TP group) before any of them writes: a refused payload
  writes nothing anywhere;
- the changed elements are written through the plan, into the parameters' own memory;
- SUM64 is a sum over elements, so each rank sums the elements it owns (held, and by no lower
  rank), read back from its parameters; the TP group's total must be the header's hash. A mismatch
  leaves the bucket's tensors at no version, so only an anchor applies to them next.
The commit checks that every tensor the rank holds is at the version: a lost bucket is refused
before the engine serves it. The sender pauses generation from the first bucket to the commit, so
a refused update is never served; the anchor that follows heals it.

Refusals. A custom loader that raises ends SGLang's scheduler, so this one never raises: it keeps
the message, and SGLang answers the next weight-update call with it as a failure (`DeltaState`).

A tensor that no rank of the TP group holds (an MTP layer the main model skips; with pipeline
parallelism, another stage's layers) is followed from version to version and not written; one held
in part only is refused. Not covered: loaders that transform values (refused at the anchor, by
name); pipeline parallelism and speculative draft models are not checked here.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from sync.delta import SGLANG_COMMIT, SUM64, DeltaError, bits, changes, header, sum64

_LAYER = re.compile(r"^(.*?\.layers\.\d+\.)")
_EXACT_INTEGERS = {  # 2^(mantissa bits + 1): the digits a float dtype holds exactly
    torch.float8_e4m3fn: 16,
    torch.float8_e5m2: 8,
    torch.bfloat16: 256,
    torch.float16: 2048,
    torch.float32: 1 << 24,
    torch.float64: 1 << 24,
}


@dataclass
class Runs:
    """Where a tensor's elements sit in one parameter: `length[j]` elements from `source[j]` of the
    tensor (flat) are at `target[j]` of the parameter (flat), runs in ascending `source`."""

    param: str
    source: torch.Tensor
    target: torch.Tensor
    length: torch.Tensor

    @classmethod
    def of(cls, param: str, source: torch.Tensor, target: torch.Tensor) -> Runs:
        """Runs of element pairs (source ascending), merged where both step by one."""
        if source.numel() == 0:
            return cls(param, source, target, source)
        breaks = (torch.diff(source) != 1) | (torch.diff(target) != 1)
        starts = torch.cat([source.new_zeros(1), torch.nonzero(breaks).view(-1) + 1])
        ends = torch.cat([starts[1:], source.new_tensor([source.numel()])])
        return cls(param, source[starts], target[starts], ends - starts)

    def locate(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Which of `positions` (tensor offsets) this parameter holds, and where (flat offsets)."""
        run = torch.searchsorted(self.source, positions, right=True) - 1
        run_ok = run.clamp(min=0)
        inside = (run >= 0) & (positions < self.source[run_ok] + self.length[run_ok])
        return inside, self.target[run_ok[inside]] + positions[inside] - self.source[run_ok[inside]]

    def expand(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every (tensor offset, parameter offset) pair of the runs."""
        if self.length.numel() == 0:
            return self.source, self.target
        within = torch.arange(int(self.length.sum()), device=self.length.device) - torch.repeat_interleave(
            torch.cumsum(self.length, 0) - self.length, self.length
        )
        return (
            torch.repeat_interleave(self.source, self.length) + within,
            torch.repeat_interleave(self.target, self.length) + within,
        )

    def restrict(self, keep: torch.Tensor) -> Runs:
        """The runs of the elements whose tensor offsets `keep` (bool over the tensor) marks."""
        source, target = self.expand()
        chosen = keep.to(source.device)[source]
        return Runs.of(self.param, source[chosen], target[chosen])

    def to(self, device: torch.device) -> Runs:
        return Runs(self.param, self.source.to(device), self.target.to(device), self.length.to(device))


@dataclass
class Placement:
    """One HF tensor on this rank: where it is held, which of those elements this rank counts in the
    tensor's hash, and the version it holds (None: only a dense payload applies). `served` is False
    for a tensor the model's loader skips on every rank (e.g. an MTP layer, which only a draft model
    loads): its versions are followed, nothing is written or hashed."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    held: list[Runs]
    owned: list[Runs]
    served: bool = True
    version: int | None = None


class DeltaState(torch.nn.Module):
    """What the loader keeps on a model (the submodule `_moe_rl_delta`): each HF tensor's placement,
    and a refused update's message until SGLang reads it. SGLang asks every module for
    `_derived_weight_cache_error` before each weight update and answers the update with it, as a
    failure (`WeightUpdater`): the way a refusal reaches the sender without ending the scheduler.
    It is read once, so the anchor that the sender then sends is loaded."""

    def __init__(self):
        super().__init__()
        self.placements: dict[str, Placement] = {}
        self.refusal: str | None = None

    @property
    def _derived_weight_cache_error(self) -> str | None:
        refusal, self.refusal = self.refusal, None
        return None if refusal is None else f"moe-rl delta sync refused the last update: {refusal}"


def load_delta(model: torch.nn.Module, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """SGLang's custom-loader entry point (module docstring). Never raises: an exception in a custom
    loader ends SGLang's scheduler. A refused update is answered on the next call instead (`DeltaState`)."""
    state = getattr(model, "_moe_rl_delta", None)
    if state is None:
        state = model._moe_rl_delta = DeltaState()  # a submodule: SGLang asks it for `_derived_weight_cache_error`
    try:  # every rank takes the same branches: the collectives inside line up
        if len(named_tensors) == 1 and named_tensors[0][0] == SGLANG_COMMIT:
            _commit(state, int(named_tensors[0][1].view(-1)[0]), _tp_group())
        elif named_tensors:
            _apply(model, state, named_tensors, _tp_group())
    except DeltaError as error:
        state.refusal = str(error)


def _apply(model: torch.nn.Module, state: DeltaState, named_tensors: list, group) -> None:
    payloads, decoded, problem = {}, {}, None
    for name, payload in named_tensors:
        payloads[name] = payload.detach().contiguous().view(-1).view(torch.uint8)  # on this rank's device
        try:
            head = header(payloads[name])
            where, values = changes(payloads[name], head)
            decoded[name] = (head, where, values)
            problem = problem or _refusal(state.placements.get(name), name, head)
        except DeltaError as error:
            problem = problem or str(error)
    _agree(problem, group)  # before any rank writes: a refused payload writes nothing anywhere
    new = {name: decoded[name] for name in payloads if name not in state.placements}
    if new:
        _place(model, state, new, group)
    params = dict(model.named_parameters())
    partials = []
    for name, (head, where, values) in decoded.items():
        placement = state.placements[name]
        placement.version = None  # until its hash is checked
        if name not in new:  # `_place` has just loaded the new ones
            _write(placement, params, where, values)
        partials.append(_owned_sum(placement, params))
    totals = torch.tensor(partials, dtype=torch.int64)
    if group is not None:
        torch.distributed.all_reduce(totals, group=group)  # int64 sums wrap: mod 2**64
    wrong = [
        name
        for name, total in zip(decoded, totals.tolist())
        if state.placements[name].served and total % (1 << 64) != decoded[name][0].hash
    ]
    if wrong:  # the same on every rank: the totals are the group's
        raise DeltaError(f"hash mismatch after applying {len(wrong)} tensors, e.g. {wrong[0]}: load an anchor")
    for name, (head, _, _) in decoded.items():
        state.placements[name].version = head.version


def _refusal(placement: Placement | None, name: str, head) -> str | None:
    """Why this rank cannot apply `head`'s payload to `name` (None: it can)."""
    if head.hash_kind != SUM64:
        return f"{name}: hashed with kind {head.hash_kind}; SGLang's ranks check SUM64 ({SUM64}) payloads"
    if head.encoding == "dense":
        if placement is not None and (placement.shape != head.shape or placement.dtype != head.dtype):
            held = f"{placement.dtype}{list(placement.shape)}"
            return f"{name}: held as {held}, the payload is {head.dtype}{list(head.shape)}"
        return None
    if placement is None or placement.version is None:
        return f"{name}: a delta arrived but this engine holds no version of it; send a full version"
    if head.base_version != placement.version:
        return f"{name}: the delta applies on version {head.base_version}, this engine holds {placement.version}"
    return None


def _commit(state: DeltaState, version: int, group) -> None:
    stale = sorted(name for name, placement in state.placements.items() if placement.version != version)
    _agree(
        f"{len(stale)} tensors are not at version {version} (a lost bucket?), e.g. {stale[0]}" if stale else None, group
    )


def _agree(problem: str | None, group) -> None:
    """Raise on every TP rank if any rank has a problem (this rank's message where it has one)."""
    flag = torch.tensor([0 if problem is None else 1], dtype=torch.int64)
    if group is not None:
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
    if flag.item():
        raise DeltaError(problem or "another TP rank refused this update; nothing was written")


def _tp_group():
    """SGLang's TP group on the CPU (gloo) side; None when the engine has one rank."""
    from sglang.srt.distributed import get_tp_group

    coordinator = get_tp_group()
    return coordinator.cpu_group if coordinator.world_size > 1 else None


def _place(model: torch.nn.Module, state: DeltaState, items: dict, group) -> None:
    """Learn where each of `items` (name -> a dense payload's header, positions, values) lands on
    this rank (module docstring), leaving the model loaded with their values."""
    tensors = {name: values.clone().view(head.dtype).view(head.shape) for name, (head, _, values) in items.items()}
    offsets, total = {}, 0
    for name, tensor in tensors.items():
        offsets[name], total = total, total + tensor.numel()
    base = min(_EXACT_INTEGERS.get(t.dtype, 0) for t in tensors.values())
    if base == 0:
        raise DeltaError(f"{list(tensors)}: delta sync into SGLang places float tensors only")
    candidates = _candidates(model, tensors)
    saved = {name: p.data.clone() for name, p in candidates.items()}
    index: dict[str, torch.Tensor] = {}
    written: dict[str, torch.Tensor] = {}
    passes = max(1, math.ceil(math.log(max(total, 2)) / math.log(base) - 1e-9))
    with torch.no_grad():
        for p in candidates.values():
            p.data.fill_(float("nan"))
        for k in range(passes):
            model.load_weights(
                [
                    (name, ((torch.arange(t.numel()) + offsets[name]) // base**k % base).to(t.dtype).view(t.shape))
                    for name, t in tensors.items()
                ]
            )
            for pname, p in candidates.items():
                flat = p.data.view(-1)
                if k == 0:
                    written[pname] = torch.nonzero(~torch.isnan(flat.float())).view(-1).cpu()
                    index[pname] = torch.zeros(written[pname].numel(), dtype=torch.int64)
                index[pname] += flat[written[pname].to(flat.device)].float().cpu().long() * base**k
        for pname, p in candidates.items():
            p.data.copy_(saved[pname])
        model.load_weights(list(tensors.items()))
    starts = torch.tensor(list(offsets.values()))
    held: dict[str, list[Runs]] = {name: [] for name in tensors}
    names = list(tensors)
    for pname, positions in written.items():
        if positions.numel() == 0:
            continue
        owner = torch.searchsorted(starts, index[pname], right=True) - 1
        for i in owner.unique().tolist():
            mine = owner == i
            source, order = torch.sort(index[pname][mine] - starts[i])
            held[names[i]].append(Runs.of(pname, source, positions[mine][order]).to(candidates[pname].device))
    params, problem = dict(model.named_parameters()), None
    for name, tensor in tensors.items():
        for runs in held[name]:
            source, target = runs.expand()
            param = params[runs.param]
            if param.dtype != tensor.dtype or not torch.equal(
                _flat_bits(param)[target], bits(tensor)[source.to(tensor.device)].to(param.device)
            ):
                problem = problem or (
                    f"{name}: SGLang's loader does not copy it as it is into {runs.param} ({param.dtype}; the "
                    f"tensor is {tensor.dtype}); deltas cannot apply to it in place, set sync.delta.enabled: false"
                )
    _agree(problem, group)
    _own(state, tensors, held, group)


def _own(state: DeltaState, tensors: dict[str, torch.Tensor], held: dict[str, list[Runs]], group) -> None:
    """Each element is counted in its tensor's hash by the lowest TP rank that holds it; a tensor
    held in part only is refused (the loader dropped or moved some of its elements)."""
    rank = 0 if group is None else torch.distributed.get_rank(group)
    size = 1 if group is None else torch.distributed.get_world_size(group)
    lowest = {}
    for name, tensor in tensors.items():
        mine = torch.full((tensor.numel(),), size, dtype=torch.int32)
        for runs in held[name]:
            mine[runs.expand()[0].cpu()] = rank
        lowest[name] = mine
    flat = torch.cat(list(lowest.values()))
    if group is not None:
        torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.MIN, group=group)
    for name, part in zip(lowest, torch.split(flat, [t.numel() for t in lowest.values()])):
        unheld = int((part == size).sum())
        if 0 < unheld < part.numel():
            raise DeltaError(f"{name}: {unheld} of its elements are held by no TP rank")
        keep = part == rank
        state.placements[name] = Placement(
            tuple(tensors[name].shape),
            tensors[name].dtype,
            held[name],
            [r.restrict(keep) for r in held[name]],
            served=unheld == 0,
        )


def _candidates(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.nn.Parameter]:
    """The parameters the tensors can land in: those of their layers (or outside every layer)."""
    prefixes = {m.group(1) if (m := _LAYER.match(name)) else None for name in tensors}
    chosen = {}
    for pname, p in model.named_parameters():
        if not p.is_floating_point():
            continue
        m = _LAYER.match(pname)
        if (m.group(1) if m else None) in prefixes:
            chosen[pname] = p
    return chosen


def _write(placement: Placement, params: dict[str, torch.Tensor], where: torch.Tensor | None, values) -> None:
    """Write one payload's elements (`sync.delta.changes`: `where` positions, a mask, or None for
    every element) where this rank holds them, one tensor at a time."""
    if where is not None and where.dtype == torch.bool:
        where = torch.nonzero(where).view(-1)
    for runs in placement.held:
        flat = _flat_bits(params[runs.param])
        if where is None:  # dense: every held element, by the runs (no position per element of the tensor)
            source, target = runs.expand()
            flat[target] = values[source.to(values.device)].to(flat.device)
        else:
            inside, target = runs.locate(where.to(runs.source.device))
            flat[target] = values[inside.to(values.device)].to(flat.device)


def _flat_bits(param: torch.Tensor) -> torch.Tensor:
    """The parameter's elements as flat integers, sharing its memory."""
    return bits(param.data)


def _owned_sum(placement: Placement, params: dict[str, torch.Tensor]) -> int:
    total = 0
    for runs in placement.owned:
        source, target = runs.expand()
        flat = _flat_bits(params[runs.param])
        total += sum64(flat[target.to(flat.device)], source.to(flat.device))
    return total % (1 << 64) - (1 << 64 if total % (1 << 64) >= 1 << 63 else 0)  # as int64 for the all-reduce
