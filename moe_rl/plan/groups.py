"""The trainer's layout as `moe-rl plan` prints it: Megatron's parallel groups and one summary line.

Megatron's order is tp-cp-ep-dp-pp, the first axis fastest. The dense part (attention, dense
MLPs, norms, embedding) is world = TP x CP x DP x PP; the expert part is world = ETP x EP x EDP x
PP, so an EP group's members are consecutive ETP blocks: they span the DP and CP ranks of a
stage (with CP > 1 the EP all-to-all runs between context-parallel ranks too, each holding its
1/cp of every sequence). The weight sync's source of a stage is its first rank (TP, CP and DP
rank 0), the same with CP as without.
"""

from __future__ import annotations

import itertools

DENSE_AXES = ("tp", "cp", "dp", "pp")
EXPERT_AXES = ("etp", "ep", "edp", "pp")


def parallel_groups(layout) -> dict[str, list[list[int]]]:
    """Global trainer ranks of every group of each axis (`layout`: a ParallelLayout)."""
    dense = [("tp", layout.tp), ("cp", layout.cp), ("dp", layout.dp), ("pp", layout.pp)]
    expert = [("etp", layout.expert_tp), ("ep", layout.ep), ("edp", layout.expert_dp), ("pp", layout.pp)]
    groups = {axis: _groups(dense, axis) for axis in DENSE_AXES}
    groups.update({axis: _groups(expert, axis) for axis in EXPERT_AXES if axis != "pp"})
    return groups


def layout_line(layout) -> str:
    """e.g. `tp 4 x cp 2 x dp 4 x pp 2 = 64 ranks; experts etp 1 x ep 16 x edp 2 x pp 2`."""
    dense = " x ".join(f"{axis} {getattr(layout, axis)}" for axis in DENSE_AXES)
    sizes = dict(etp=layout.expert_tp, ep=layout.ep, edp=layout.expert_dp, pp=layout.pp)
    expert = " x ".join(f"{axis} {sizes[axis]}" for axis in EXPERT_AXES)
    return f"{dense} = {layout.world_size} ranks (order tp-cp-ep-dp-pp); experts {expert}"


def _groups(dims: list[tuple[str, int]], axis: str) -> list[list[int]]:
    strides, stride = {}, 1
    for name, size in dims:
        strides[name], stride = stride, stride * size
    others = [(name, size) for name, size in dims if name != axis]
    size = dict(dims)[axis]
    result = []
    for coords in itertools.product(*(range(s) for _, s in reversed(others))):
        base = sum(c * strides[name] for c, (name, _) in zip(coords, reversed(others)))
        result.append([base + i * strides[axis] for i in range(size)])
    return sorted(result)


def span(group: list[int]) -> str:
    """A group as `[a..b]` or `[a..b step k]` where evenly spaced, else its list."""
    if len(group) > 1 and all(b - a == group[1] - group[0] for a, b in zip(group, group[1:])):
        step = group[1] - group[0]
        return f"[{group[0]}..{group[-1]}{'' if step == 1 else f' step {step}'}]"
    return str(group)
