"""Build this rank's part of a Megatron GPTModel from an HF config and a parallel layout.

Training precision (`PRECISIONS`): "fp32" builds fp32 parameters and activations; "bf16" builds
bf16 parameters and activations (`precision_config`: TransformerConfig bf16, params_dtype and
pipeline_dtype), and `with_precision` wraps the model in megatron-core's Float16Module, which hands
the last stage's logits back in fp32, as Megatron-LM does. The fp32 main parameters and fp32
gradient reduction of bf16 training belong to the optimizer and DDP (moe_rl.trainer).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from parallel import cpu_compat
from parallel.bridges import Bridge
from parallel.context import init_ep_rails
from parallel.layout import ParallelLayout
from parallel.router import RouterTraining
from parallel.world import node_names

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""Training precision -> dtype of the model's parameters and activations."""


def precision_config(precision: str) -> dict[str, Any]:
    """The TransformerConfig fields of a training precision (a key of `PRECISIONS`)."""
    dtype = PRECISIONS[precision]
    return dict(params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16)


def with_precision(model):
    """`model` (a GPTModel) as megatron-core runs it in its config's precision: in bf16 wrapped in
    Float16Module (logits upcast to fp32 on the last stage), in fp32 unchanged. Float16Module casts
    buffers too; the fp32 ones (routers' score biases and token counts) are kept fp32, so weights
    imported before the first forward are not rounded (megatron-core itself restores only the bias,
    at the router's forward)."""
    if not model.config.bf16:
        return model
    # heavy: megatron-core, loaded only where a model is built (after parallel.cpu_compat.apply)
    from megatron.core.transformer.module import Float16Module

    fp32 = [(m, n) for m in model.modules() for n, b in m.named_buffers(recurse=False) if b.dtype == torch.float32]
    wrapped = Float16Module(model.config, model)
    for module, name in fp32:
        setattr(module, name, getattr(module, name).float())
    return wrapped


def unwrap(model):
    """The GPTModel inside its wrappers (DDP, Float16Module)."""
    # heavy: megatron-core, loaded only where a model is built (after parallel.cpu_compat.apply)
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

    while isinstance(model, (DistributedDataParallel, Float16Module)):
        model = model.module
    return model


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
    cpu_compat.apply()
    # heavy: megatron-core, loaded only where a model is built (after parallel.cpu_compat.apply)
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
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
    )
    init_ep_rails(node_names())  # EP gathers that reach the root's node through several NICs
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def build_gpt_model(
    bridge: Bridge,
    layout: ParallelLayout,
    use_te: bool | None = None,
    router: RouterTraining | None = None,
    **config_overrides: Any,
):
    """This rank's pipeline stage of the model, on the local device (random init).

    Call after `init_model_parallel`. `use_te`: the Transformer Engine spec (None: where TE is
    available, see `use_transformer_engine`). `router`: how the routers train (`parallel.router`;
    default: they train, no load-balancing loss, no expert-bias update). Returns the bare GPTModel
    (no DDP wrapper).
    """
    # heavy: megatron-core, loaded only where a model is built (after parallel.cpu_compat.apply)
    from megatron.core import parallel_state

    if use_te is None:
        use_te = use_transformer_engine()
    router = router or RouterTraining()
    config = bridge.transformer_config(layout, router, **config_overrides)
    layer_spec, mtp_spec = bridge.layer_spec(config, use_te=use_te), bridge.mtp_block_spec(config, use_te=use_te)
    if not use_te and layout.cp > 1:  # the local spec's attention refuses CP: gather K/V eagerly
        # heavy: the eager attention module imports megatron-core at its top
        from parallel.eager_attention import use_eager_attention

        use_eager_attention(layer_spec)
        use_eager_attention(mtp_spec)
    model = _gpt_model_class()(
        config=config,
        transformer_layer_spec=layer_spec,
        mtp_block_spec=mtp_spec,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        **bridge.gpt_model_kwargs(layout),
    )
    router.apply(model)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


@functools.cache
def _gpt_model_class():
    # heavy: megatron-core, loaded only where a model is built (after parallel.cpu_compat.apply)
    from megatron.core.models.gpt import GPTModel

    class LogitsGPTModel(GPTModel):
        """GPTModel that returns logits with an MTP block too. megatron-core 0.16 runs MTP only when
        given labels, adding each MTP layer's loss (layer k predicts the token k + 2 ahead, over
        `loss_mask`, times `mtp_loss_scaling_factor`) to the backward through the hidden states, and
        then returns the main tokens' cross entropy, computed in place over the logits. Here the MTP
        layers' losses are computed as Megatron does and the main logits come back untouched
        ([s, b, vocab / tp]), for the RL loss to read. Also: 0.16's `sharded_state_dict` ties the
        MTP stage's embedding copy through `metadata["dp_cp_group"]` without defaulting it."""

        def forward(self, *args, **kwargs):
            self._losses_left = self.config.mtp_num_layers or 0
            return super().forward(*args, **kwargs)

        def compute_language_model_loss(self, labels, logits):
            if self._losses_left == 0:  # after the MTP layers' losses: the main output
                return logits
            self._losses_left -= 1
            return super().compute_language_model_loss(labels, logits)

        def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
            # heavy: megatron-core, loaded only where a model is built (after parallel.cpu_compat.apply)
            from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

            return super().sharded_state_dict(prefix, sharded_offsets, ensure_metadata_has_dp_cp_group(metadata))

    return LogitsGPTModel


def forward(
    model,
    inputs: torch.Tensor,
    positions: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    packed_seq_params=None,
    padding_mask: torch.Tensor | None = None,
):
    """One stage's forward: logits [b, s, vocab / tp] on the last stage, hidden states elsewhere.
    `labels` (the next tokens, [b, s]) and `loss_mask` are what an MTP block trains on; a model
    without MTP ignores them. `packed_seq_params` (megatron-core's PackedSeqParams, THD): `inputs`
    is [1, T], several sequences delimited by its cu_seqlens (Transformer Engine attention only).
    `padding_mask` (bool [b, s], True = padding): inputs the routers leave out of their token counts
    (the expert-bias update) and load-balancing losses; the outputs do not change."""
    core = unwrap(model)
    kwargs = {} if packed_seq_params is None else dict(packed_seq_params=packed_seq_params)
    if padding_mask is not None:
        kwargs["padding_mask"] = _stage_padding_mask(core, padding_mask)
    if core.config.mtp_num_layers is None:
        return model(inputs, positions, attention_mask=None, **kwargs)
    output = model(inputs, positions, attention_mask=None, labels=labels, loss_mask=loss_mask, **kwargs)
    return output.transpose(0, 1).contiguous() if core.post_process else output


def _stage_padding_mask(core, padding_mask: torch.Tensor) -> torch.Tensor:
    """The padding mask as this stage's routers need it. megatron-core (0.16, 0.19) splits it over
    TP ranks under sequence parallel on the first pipeline stage only; later stages get their
    rank's chunk of the sequence here, as the first stage's split gives it."""
    if core.pre_process or not core.config.sequence_parallel:
        return padding_mask
    # heavy: megatron-core, loaded only where a model is built (after parallel.cpu_compat.apply)
    from megatron.core import parallel_state

    tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    return padding_mask.chunk(tp, dim=1)[rank].contiguous()
