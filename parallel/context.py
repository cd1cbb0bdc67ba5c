"""Where this rank sits in a built Megatron model's world: what the export, the import and the LoRA
adapters all read before they touch a parameter.

`parallel_context(model, bridge)` returns the `ParallelContext` that the mapping kinds
(`parallel.mappings`) take: the TP, ETP and EP groups with this rank's place in each, the pipeline
stage and its first layer, and whether this rank is in the data-parallel replica that exports.
`uses_transformer_engine(model)` says which layer spec built the model (the bridges' tables name
TE's fused parameters differently). Both are local: no collective, no memory beyond the record.
"""

from __future__ import annotations

from parallel.bridges import Bridge
from parallel.mappings import Axis, ParallelContext


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
    )


def uses_transformer_engine(model) -> bool:
    """True when the model was built from the TE spec (its table has TE's fused names)."""
    return any(type(m).__module__.startswith("megatron.core.extensions.transformer_engine") for m in model.modules())
