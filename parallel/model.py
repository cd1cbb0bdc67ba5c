"""Build this rank's part of a Megatron GPTModel from an HF config and a parallel layout."""

from __future__ import annotations

from typing import Any

import torch

from parallel import cpu_compat
from parallel.bridges import Bridge
from parallel.layout import ParallelLayout


def use_transformer_engine() -> bool:
    """TE spec on GPUs with TE installed; megatron-core's local spec otherwise (CPU)."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def init_model_parallel(layout: ParallelLayout, seed: int) -> None:
    """Create Megatron's parallel groups on the current default world and seed its RNGs.

    Every rank of the world must call it; the world size must equal `layout.world_size`.
    """
    import torch.distributed as dist

    cpu_compat.apply()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if dist.get_world_size() != layout.world_size:
        raise ValueError(
            f"layout.world_size={layout.world_size} but {dist.get_world_size()} ranks were launched: make them equal"
        )
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def build_gpt_model(bridge: Bridge, layout: ParallelLayout, use_te: bool | None = None, **config_overrides: Any):
    """This rank's pipeline stage of the model, on the local device (random init).

    Call after `init_model_parallel`. `use_te`: the Transformer Engine spec (None: where TE is
    available, see `use_transformer_engine`). Returns the bare GPTModel (no DDP wrapper).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    if use_te is None:
        use_te = use_transformer_engine()
    config = bridge.transformer_config(layout, **config_overrides)
    model = GPTModel(
        config=config,
        transformer_layer_spec=bridge.layer_spec(config, use_te=use_te),
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        **bridge.gpt_model_kwargs(layout),
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model
