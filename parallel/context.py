"""Where this rank sits in a built Megatron model's world: what the export, the import and the LoRA
adapters all read before they touch a parameter.

`parallel_context(model, bridge)` returns the `ParallelContext` that the mapping kinds
(`parallel.mappings`) take: the TP, ETP and EP groups with this rank's place in each, the pipeline
stage and its first layer, and whether this rank is in the data-parallel replica that exports.
`uses_transformer_engine(model)` says which layer spec built the model (the bridges' tables name
TE's fused parameters differently). Both are local: no collective, no memory beyond the record.
`init_ep_rails(nodes)` (collective, from `parallel.model.init_model_parallel`) forms the groups of
the EP gather's two hops (`parallel.gathers.Rails`) for every EP group that spans nodes.
"""

from __future__ import annotations

import torch.distributed as dist

from parallel.bridges import Bridge
from parallel.mappings import Axis, ParallelContext, Rails

_EP_RAILS: tuple[object, Rails] | None = None
"""(the EP group they were formed for, this rank's rails), like Megatron's own group globals."""


def parallel_context(model, bridge: Bridge) -> ParallelContext:
    """This rank's place in the Megatron world (after `init_model_parallel`)."""
    # heavy: megatron-core, imported only once a model exists (and after parallel.cpu_compat.apply)
    from megatron.core import parallel_state as ps

    layers = model.decoder.layers
    num_experts = int(getattr(model.config, "num_moe_experts", None) or 0)
    ep = ps.get_expert_model_parallel_world_size()
    return ParallelContext(
        tp=Axis(
            ps.get_tensor_model_parallel_group(),
            ps.get_tensor_model_parallel_rank(),
            ps.get_tensor_model_parallel_world_size(),
        ),
        etp=Axis(
            ps.get_expert_tensor_parallel_group(),
            ps.get_expert_tensor_parallel_rank(),
            ps.get_expert_tensor_parallel_world_size(),
        ),
        ep=Axis(ps.get_expert_model_parallel_group(), ps.get_expert_model_parallel_rank(), ep),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        layer_offset=layers[0].layer_number - 1 if len(layers) else 0,
        num_local_experts=num_experts // ep,
        vocab_size=bridge.vocab_size,
        in_source_replica=ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0,
        in_expert_source_replica=ps.get_expert_data_parallel_rank() == 0,
        ep_rails=_EP_RAILS[1] if _EP_RAILS and _EP_RAILS[0] is ps.get_expert_model_parallel_group() else None,
    )


def init_ep_rails(nodes: list[str]) -> None:
    """Form the rails of every EP group whose members span nodes (`nodes[rank]`: the node of each
    rank, `parallel.world.node_names`) and keep this rank's. Collective: every rank creates every
    group, in the same order. An EP group on one node, or with one member on the root's node,
    keeps the one-hop gather."""
    global _EP_RAILS
    # heavy: megatron-core, imported only once its groups exist (after parallel.cpu_compat.apply)
    from megatron.core import parallel_state as ps

    mine = ps.get_expert_model_parallel_group()
    groups: list = [None] * dist.get_world_size()
    dist.all_gather_object(groups, tuple(dist.get_process_group_ranks(mine)))
    me, rails = dist.get_rank(), None
    for members in sorted(set(groups)):
        root_node = nodes[members[0]]
        on = [m for m in members if nodes[m] == root_node]  # the rails, the root first
        off = [m for m in members if nodes[m] != root_node]
        if not off or len(on) == 1:
            continue
        riders = [[m for i, m in enumerate(off) if i % len(on) == r] for r in range(len(on))]
        rail_groups = [dist.new_group([rail, *ride]) if ride else None for rail, ride in zip(on, riders)]
        node_group = dist.new_group(on)
        if me not in members:
            continue
        rail_axis = None
        for rail, ride, group in zip(on, riders, rail_groups):
            if me in (rail, *ride) and group is not None:
                rail_axis = Axis(group, [rail, *ride].index(me), 1 + len(ride))
        node_axis = Axis(node_group, on.index(me), len(on)) if me in on else None
        holds = tuple(tuple(members.index(m) for m in [rail, *ride]) for rail, ride in zip(on, riders))
        rails = Rails(rail_axis, node_axis, holds)
    _EP_RAILS = (mine, rails) if rails is not None else None


def uses_transformer_engine(model) -> bool:
    """True when the model was built from the TE spec (its table has TE's fused names)."""
    return any(type(m).__module__.startswith("megatron.core.extensions.transformer_engine") for m in model.modules())
