"""Test fixture: a CPU stand-in for Transformer Engine (TE needs CUDA and cannot be installed here).

`install()` puts a fake `transformer_engine` package into `sys.modules`, so megatron-core's
`megatron.core.extensions.transformer_engine` (0.16.1) defines its TE wrappers
(TELayerNormColumnParallelLinear, TEColumnParallelLinear, TERowParallelLinear, TEGroupedLinear,
TENorm, TEDotProductAttention) on top of it and `get_gpt_decoder_block_spec(use_transformer_engine=True)`
builds the TE-spec model: TE's parameter names and shapes, megatron's own wrapper code. Call it in
a fresh process (a `parallel.world.spawn` rank) before anything imports megatron-core, which
decides `HAVE_TE` at import; never at the import of a test module.

What it implements, in plain torch, after TE 2.9's `transformer_engine/pytorch/module/*.py`
(NVIDIA/TransformerEngine tag v2.9, read, not installed):
- `Linear`, `LayerNormLinear` (RMSNorm / LayerNorm fused before the GEMM; `return_layernorm_output`
  returns the normed input, `return_layernorm_output_gathered` the sequence-gathered one),
  `GroupedLinear` (`weight{i}` / `bias{i}`, forward(x, m_splits) splits the tokens by m_splits),
  `RMSNorm`, `LayerNorm`, and `DotProductAttention` (sbhd, GQA, causal or no mask, via SDPA; and
  packed sequences, thd with `cu_seqlens` as megatron's PackedSeqParams hands them: attention
  computed sequence by sequence, causal within each, as TE's `padding_causal`; context parallelism
  over megatron's CP group, sbhd and thd, keys and values gathered over it);
- the tensor-parallel communication TE does inside its modules when megatron hands it a tp_group
  and parallel_mode: column-parallel gathers the sequence-parallel input (else copies it: its
  gradient is all-reduced), row-parallel reduce-scatters (else all-reduces) its output. They run
  through megatron-core's autograd region functions on gloo. Expert linears get no TE comm
  (megatron passes parallel_mode=None and does it in the token dispatcher), as with TE;
- parameter names, shapes and attributes as TE sets them: `weight`, `bias`, `layer_norm_weight`
  (`layer_norm_bias` only under LayerNorm), `weight{i}`, tensor-parallel attributes, the norms'
  `sequence_parallel`, an empty `_extra_state`.
What it does not: FP8/FP4, fused kernels and ops (`te.pytorch.ops`, fused router and permute,
TE's RoPE and cross entropy: megatron's unfused RoPE applies it per cu_seqlens segment), userbuffer
overlap, hierarchical CP communication (a2a+p2p; p2p, all_gather and a2a are all computed by gathering
keys and values),
padded packed sequences (`cu_seqlens_*_padded`), cross-attention
packing (cu_seqlens_q != cu_seqlens_kv), attention masks other than causal / none, attention
dropout, sliding windows, TE's RNG tracker (weights are initialised without megatron's RNG fork;
tests load them from a checkpoint), TE's
activation recompute and optimizers (megatron-core falls back to its own). They raise where
megatron would reach them, or are absent so that megatron takes its non-TE path.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import sys
import types
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel.context_parallel import ContextSplit

VERSION = "2.9.0"
"""The TE version reported to megatron-core (its wrappers branch on it)."""


def install() -> None:
    """Register the stand-in as `transformer_engine` (idempotent); before megatron-core is imported."""
    current = sys.modules.get("transformer_engine")
    if current is not None:
        if getattr(current, "IS_CPU_STANDIN", False):
            return
        raise RuntimeError("a real transformer_engine is imported; the stand-in would shadow it")
    imported = sorted(name for name in sys.modules if name.startswith("megatron.core"))
    if imported:
        raise RuntimeError(f"install the TE stand-in before megatron-core is imported (already: {imported[:3]})")
    te = _module("transformer_engine", __version__=VERSION, IS_CPU_STANDIN=True)
    common = _module("transformer_engine.common")
    recipe = _module("transformer_engine.common.recipe", DelayedScaling=DelayedScaling, Format=Format)
    pytorch = _module(
        "transformer_engine.pytorch",
        Linear=Linear,
        LayerNormLinear=LayerNormLinear,
        GroupedLinear=GroupedLinear,
        RMSNorm=RMSNorm,
        LayerNorm=LayerNorm,
        DotProductAttention=DotProductAttention,
    )
    fp8 = _module(
        "transformer_engine.pytorch.fp8",
        FP8GlobalStateManager=FP8GlobalStateManager,
        fp8_autocast=fp8_autocast,
        fp8_model_init=fp8_model_init,
    )
    distributed = _module(
        "transformer_engine.pytorch.distributed",
        CudaRNGStatesTracker=CudaRNGStatesTracker,
        activation_recompute_forward=_unsupported("activation_recompute_forward"),
    )
    tensor = _module("transformer_engine.pytorch.tensor", QuantizedTensor=QuantizedTensor)
    router = _module(
        "transformer_engine.pytorch.router",
        **{  # fused routing: megatron's moe_router_fusion
            name: _unsupported(name)
            for name in ("fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_topk_with_score_function")
        },
    )
    ops = _module("transformer_engine.pytorch.ops", Sequential=_Unsupported, FusibleOperation=_Unsupported)
    te.common, common.recipe = common, recipe
    te.pytorch = pytorch
    for name, sub in dict(fp8=fp8, distributed=distributed, tensor=tensor, router=router, ops=ops).items():
        setattr(pytorch, name, sub)


def _module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None)  # find_spec() works on it
    module.__dict__.update(attrs)
    sys.modules[name] = module
    return module


# -- what megatron-core only names (FP8, fused ops, TE's RNG tracker) --------------------------------
class _Unsupported:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__}: not in the CPU stand-in for Transformer Engine")


def _unsupported(name: str) -> Callable:
    def fail(*args, **kwargs):
        raise NotImplementedError(f"{name}: not in the CPU stand-in for Transformer Engine")

    return fail


class DelayedScaling(_Unsupported):
    pass


class CudaRNGStatesTracker(_Unsupported):
    pass


class Format:
    E4M3, HYBRID = "E4M3", "HYBRID"


class QuantizedTensor(torch.Tensor):
    """Never instantiated: nothing is quantized."""


class FP8GlobalStateManager:
    @staticmethod
    def is_fp8_enabled() -> bool:
        return False

    @staticmethod
    def fp8_graph_capturing() -> bool:
        return False

    @staticmethod
    def with_fp8_parameters() -> bool:
        return False


@contextlib.contextmanager
def fp8_autocast(enabled: bool = False, **kwargs):
    if enabled:
        raise NotImplementedError("FP8 is not in the CPU stand-in for Transformer Engine")
    yield


@contextlib.contextmanager
def fp8_model_init(enabled: bool = False, **kwargs):
    """megatron-core 0.19 imports it with fp8_autocast (its HAVE_TE test): FP8 weights at init."""
    if enabled:
        raise NotImplementedError("FP8 is not in the CPU stand-in for Transformer Engine")
    yield


# -- modules -----------------------------------------------------------------------------------------
def _refuse(module: str, options: dict) -> None:
    """TE options the stand-in does not implement must be off (megatron passes them off by default)."""
    on = {k: v for k, v in options.items() if v not in (None, False, 0, "vanilla", "p2p")}
    if on:
        raise NotImplementedError(f"{module}: {on} not in the CPU stand-in for Transformer Engine")


def _tp_attributes(param: torch.Tensor, is_parallel: bool, dim: int) -> None:
    param.tensor_model_parallel, param.partition_dim, param.partition_stride = is_parallel, dim, 1


class _BaseModule(torch.nn.Module):
    """TransformerEngineBaseModule: the tensor-parallel group and the (empty) FP8 state."""

    def __init__(self, tp_group, tp_size: int):
        super().__init__()
        self.fp8 = self.fp8_calibration = False
        self.fp8_meta = {"fp8_checkpoint": False}
        if tp_group is None:
            self.tp_size, self.tp_group = tp_size, None
        else:
            self.tp_size = torch.distributed.get_world_size(tp_group)
            self.tp_group = tp_group

    def set_tensor_parallel_group(self, tp_group) -> None:
        self.tp_group = tp_group

    def init_fp8_metadata(self, num_gemms: int = 1) -> None:
        pass  # no FP8 state to set up (megatron's grouped-linear load hook calls it)

    def get_extra_state(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)  # TE 2.x: no FP8 state

    def set_extra_state(self, state) -> None:
        pass

    def _new_param(self, name: str, shape: tuple, init: Callable, device, dtype) -> None:
        # TE draws the init inside megatron's RNG tracker fork; here the weights come from a
        # checkpoint, and a fork on the CPU generator only warns, so init draws directly.
        param = torch.nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        with torch.no_grad():
            init(param)
        self.register_parameter(name, param)


def _constant(value: float) -> Callable:
    return lambda t: torch.nn.init.constant_(t, value)


class _ParallelLinear(_BaseModule):
    """Shared by Linear and LayerNormLinear: sizes, parameters and TE's TP communication."""

    def __init__(
        self,
        in_features,
        out_features,
        *,
        sequence_parallel,
        tp_group,
        tp_size,
        init_method,
        bias,
        return_bias,
        params_dtype,
        parallel_mode,
        device,
    ):
        super().__init__(tp_group, tp_size)
        if parallel_mode not in (None, "column", "row"):
            raise ValueError(f"parallel_mode={parallel_mode!r}")
        self.parallel_mode = parallel_mode
        self.in_features, self.out_features = in_features, out_features
        if parallel_mode == "column":
            self.out_features //= self.tp_size
        elif parallel_mode == "row":
            self.in_features //= self.tp_size
        self.sequence_parallel = self.tp_size > 1 and sequence_parallel
        self.use_bias, self.return_bias = bias, return_bias
        self.apply_bias = bias and not return_bias
        dtype = params_dtype or torch.get_default_dtype()
        init = init_method or (lambda w: torch.nn.init.normal_(w, 0.0, 0.023))
        self._new_param("weight", (self.out_features, self.in_features), init, device, dtype)
        _tp_attributes(self.weight, True, 1 if parallel_mode == "row" else 0)
        if bias:
            self._new_param("bias", (self.out_features,), _constant(0.0), device, dtype)
            if parallel_mode == "row":
                self.bias.sequence_parallel = self.sequence_parallel
            elif parallel_mode == "column":
                _tp_attributes(self.bias, True, 0)
        else:
            self.bias = torch.Tensor().to(dtype=dtype, device=device)

    def _column_input(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings

        if self.parallel_mode != "column" or self.tp_size == 1:
            return x
        if self.sequence_parallel:  # all-gather the sequence; backward reduce-scatters
            return mappings.gather_from_sequence_parallel_region(x, group=self.tp_group)
        return mappings.copy_to_tensor_model_parallel_region(x, group=self.tp_group)  # backward all-reduces

    def _gemm(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        from megatron.core.tensor_parallel import mappings

        row = self.parallel_mode == "row"
        out = F.linear(x, self.weight, self.bias if self.apply_bias and not row else None)
        if row and self.tp_size > 1:
            if self.sequence_parallel:
                out = mappings.reduce_scatter_to_sequence_parallel_region(out, group=self.tp_group)
            else:
                out = mappings.reduce_from_tensor_model_parallel_region(out, group=self.tp_group)
        if row and self.apply_bias:  # added after the reduction, as TE does
            out = out + self.bias
        return (out, self.bias) if self.return_bias else out


class Linear(_ParallelLinear):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        sequence_parallel: bool = False,
        fuse_wgrad_accumulation: bool = False,
        tp_group=None,
        tp_size: int = 1,
        get_rng_state_tracker=None,
        rng_tracker_name=None,
        init_method=None,
        bias: bool = True,
        return_bias: bool = False,
        params_dtype=None,
        parallel_mode=None,
        device="cuda",
        ub_name=None,
        **options,
    ):
        _refuse("Linear", dict(fuse_wgrad_accumulation=fuse_wgrad_accumulation, **options))
        super().__init__(
            in_features,
            out_features,
            sequence_parallel=sequence_parallel,
            tp_group=tp_group,
            tp_size=tp_size,
            init_method=init_method,
            bias=bias,
            return_bias=return_bias,
            params_dtype=params_dtype,
            parallel_mode=parallel_mode,
            device=_device(device),
        )
        self.ub_name = ub_name

    def forward(self, inp: torch.Tensor, is_first_microbatch=None):
        return self._gemm(self._column_input(inp))


def _normalize(x, weight, bias, eps: float, normalization: str, zero_centered_gamma: bool) -> torch.Tensor:
    gamma = weight + 1 if zero_centered_gamma else weight
    if normalization == "RMSNorm":
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * gamma
    return F.layer_norm(x, x.shape[-1:], gamma, bias, eps)


class LayerNormLinear(_ParallelLinear):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        eps: float = 1e-5,
        sequence_parallel: bool = False,
        fuse_wgrad_accumulation: bool = False,
        tp_group=None,
        tp_size: int = 1,
        get_rng_state_tracker=None,
        init_method=None,
        bias: bool = True,
        normalization: str = "LayerNorm",
        return_bias: bool = False,
        params_dtype=None,
        parallel_mode=None,
        return_layernorm_output: bool = False,
        return_layernorm_output_gathered: bool = False,
        zero_centered_gamma: bool = False,
        device="cuda",
        ub_name=None,
        rng_tracker_name=None,
        **options,
    ):
        _refuse("LayerNormLinear", dict(fuse_wgrad_accumulation=fuse_wgrad_accumulation, **options))
        if normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"normalization={normalization!r}")
        device = _device(device)
        super().__init__(
            in_features,
            out_features,
            sequence_parallel=sequence_parallel,
            tp_group=tp_group,
            tp_size=tp_size,
            init_method=init_method,
            bias=bias,
            return_bias=return_bias,
            params_dtype=params_dtype,
            parallel_mode=parallel_mode,
            device=device,
        )
        self.eps, self.normalization, self.zero_centered_gamma = eps, normalization, zero_centered_gamma
        self.return_layernorm_output = return_layernorm_output
        self.return_layernorm_output_gathered = return_layernorm_output_gathered and return_layernorm_output
        self.ub_name = ub_name
        dtype = self.weight.dtype
        # TE registers the norm's parameters over the (unsplit) input features.
        self._new_param("layer_norm_weight", (in_features,), _constant(float(not zero_centered_gamma)), device, dtype)
        self.layer_norm_weight.sequence_parallel = self.sequence_parallel
        if normalization == "LayerNorm":
            self._new_param("layer_norm_bias", (in_features,), _constant(0.0), device, dtype)
            self.layer_norm_bias.sequence_parallel = self.sequence_parallel
        else:
            self.layer_norm_bias = None

    def forward(self, inp: torch.Tensor, is_first_microbatch=None):
        normed = _normalize(
            inp, self.layer_norm_weight, self.layer_norm_bias, self.eps, self.normalization, self.zero_centered_gamma
        )
        gathered = self._column_input(normed)
        out = self._gemm(gathered)
        if not self.return_layernorm_output:
            return out
        normed_out = gathered if self.return_layernorm_output_gathered else normed
        return (*out, normed_out) if self.return_bias else (out, normed_out)


class GroupedLinear(_BaseModule):
    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        sequence_parallel: bool = False,
        fuse_wgrad_accumulation: bool = False,
        tp_group=None,
        tp_size: int = 1,
        get_rng_state_tracker=None,
        rng_tracker_name=None,
        init_method=None,
        bias: bool = True,
        return_bias: bool = False,
        params_dtype=None,
        parallel_mode=None,
        device="cuda",
        ub_name=None,
        **options,
    ):
        _refuse("GroupedLinear", dict(fuse_wgrad_accumulation=fuse_wgrad_accumulation, **options))
        super().__init__(tp_group, tp_size)
        if self.tp_size > 1:  # megatron always hands expert TP to its dispatcher (parallel_mode=None)
            raise NotImplementedError("GroupedLinear with TE-internal tensor parallelism")
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.parallel_mode, self.sequence_parallel, self.ub_name = parallel_mode, False, ub_name
        self.use_bias, self.return_bias = bias, return_bias
        self.apply_bias = bias and not return_bias
        device, dtype = _device(device), params_dtype or torch.get_default_dtype()
        init = init_method or (lambda w: torch.nn.init.normal_(w, 0.0, 0.023))
        for i in range(num_gemms):
            self._new_param(f"weight{i}", (out_features, in_features), init, device, dtype)
            _tp_attributes(getattr(self, f"weight{i}"), True, 1 if parallel_mode == "row" else 0)
            if bias:
                self._new_param(f"bias{i}", (out_features,), _constant(0.0), device, dtype)
            else:
                setattr(self, f"bias{i}", torch.Tensor().to(dtype=dtype, device=device))

    def forward(self, inp: torch.Tensor, m_splits: list[int], is_first_microbatch=None):
        if len(m_splits) != self.num_gemms:
            raise ValueError(f"{len(m_splits)} splits for {self.num_gemms} GEMMs")
        biases = [getattr(self, f"bias{i}") for i in range(self.num_gemms)]
        outs = [
            F.linear(x, getattr(self, f"weight{i}"), biases[i] if self.apply_bias else None)
            for i, x in enumerate(torch.split(inp, list(m_splits)))
        ]
        out = torch.cat(outs) if outs else inp.new_empty(0, self.out_features)
        return (out, biases) if self.return_bias else out


class _Norm(_BaseModule):
    def __init__(
        self,
        normalization: str,
        normalized_shape,
        eps,
        sequence_parallel,
        params_dtype,
        zero_centered_gamma,
        hidden_size,
        device="cuda",
        dtype=None,
        **options,
    ):
        _refuse(normalization, options)
        super().__init__(None, 1)
        shape = normalized_shape if normalized_shape is not None else hidden_size
        self.normalization, self.eps, self.zero_centered_gamma = normalization, eps, zero_centered_gamma
        dtype, device = dtype or params_dtype or torch.get_default_dtype(), _device(device)
        self._new_param("weight", (shape,), _constant(float(not zero_centered_gamma)), device, dtype)
        if normalization == "LayerNorm":
            self._new_param("bias", (shape,), _constant(0.0), device, dtype)
        else:
            self.bias = None
        if sequence_parallel is not None:
            for param in self.parameters():
                param.sequence_parallel = sequence_parallel

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        return _normalize(inp, self.weight, self.bias, self.eps, self.normalization, self.zero_centered_gamma)


class RMSNorm(_Norm):
    def __init__(
        self,
        normalized_shape=None,
        eps: float = 1e-5,
        sequence_parallel=None,
        params_dtype=None,
        zero_centered_gamma: bool = False,
        hidden_size=None,
        **kwargs,
    ):
        super().__init__(
            "RMSNorm",
            normalized_shape,
            eps,
            sequence_parallel,
            params_dtype,
            zero_centered_gamma,
            hidden_size,
            **kwargs,
        )


class LayerNorm(_Norm):
    def __init__(
        self,
        normalized_shape=None,
        eps: float = 1e-5,
        sequence_parallel=None,
        params_dtype=None,
        zero_centered_gamma: bool = False,
        hidden_size=None,
        **kwargs,
    ):
        super().__init__(
            "LayerNorm",
            normalized_shape,
            eps,
            sequence_parallel,
            params_dtype,
            zero_centered_gamma,
            hidden_size,
            **kwargs,
        )


class DotProductAttention(torch.nn.Module):
    """Core attention on [s, b, heads, d] (sbhd) or packed [t, heads, d] (thd, sequences delimited
    by cu_seqlens): this rank's heads, GQA, causal or no mask. Context parallelism (a `cp_group` of
    more than one rank, given at construction or by `set_context_parallel_group`): this rank holds
    chunks r and 2cp-1-r of the sequence (of each thd segment, cu_seqlens being the whole
    sequence's); keys and values are gathered over the group, as TE's `all_gather` CP communication
    does (its `p2p` ring and `a2a` compute the same attention otherwise), and the local queries attend
    at their global positions. The gather's backward sums key/value gradients over the group."""

    def __init__(
        self,
        num_attention_heads: int,
        kv_channels,
        num_gqa_groups=None,
        attention_dropout: float = 0.0,
        qkv_format: str = "sbhd",
        attn_mask_type: str = "causal",
        sequence_parallel: bool = False,
        tp_size: int = 1,
        get_rng_state_tracker=None,
        tp_group=None,
        layer_number=None,
        attention_type: str = "self",
        softmax_scale=None,
        cp_group=None,
        cp_global_ranks=None,
        cp_stream=None,
        cp_comm_type: str = "p2p",
        **options,
    ):
        _refuse("DotProductAttention", dict(attention_dropout=attention_dropout, **options))
        super().__init__()
        if qkv_format != "sbhd" or attention_type != "self":
            raise NotImplementedError(f"qkv_format={qkv_format!r}, attention_type={attention_type!r}")
        key_channels = kv_channels[0] if isinstance(kv_channels, tuple) else kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else key_channels**-0.5
        self.attn_mask_type = attn_mask_type
        self.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream, cp_comm_type: str = "p2p") -> None:
        if cp_comm_type not in ("p2p", "all_gather", "a2a"):
            raise NotImplementedError(f"cp_comm_type={cp_comm_type!r} not in the CPU stand-in")
        self.cp_group = cp_group if cp_group is not None and dist.get_world_size(cp_group) > 1 else None

    def forward(
        self,
        query_layer,
        key_layer,
        value_layer,
        attention_mask=None,
        attn_mask_type=None,
        core_attention_bias_type: str = "no_bias",
        core_attention_bias=None,
        qkv_format=None,
        cu_seqlens_q=None,
        cu_seqlens_kv=None,
        max_seqlen_q=None,
        max_seqlen_kv=None,
        **options,
    ):
        _refuse("DotProductAttention.forward", dict(core_attention_bias=core_attention_bias, **options))
        mask_type = attn_mask_type or self.attn_mask_type
        if qkv_format == "thd":
            return self._packed(query_layer, key_layer, value_layer, mask_type, cu_seqlens_q, cu_seqlens_kv)
        if qkv_format not in (None, "sbhd"):
            raise NotImplementedError(f"qkv_format={qkv_format!r}")
        if mask_type not in ("causal", "no_mask"):
            raise NotImplementedError(f"attn_mask_type={mask_type!r}")
        seq, batch, heads, _ = query_layer.shape
        if self.cp_group is not None:
            segments = [seq * dist.get_world_size(self.cp_group)]
            out = self._context_parallel(query_layer, key_layer, value_layer, segments, mask_type == "causal")
            return out.reshape(seq, batch, -1)
        out = self._attend(*(t.permute(1, 2, 0, 3) for t in (query_layer, key_layer, value_layer)), mask_type)
        return out.permute(2, 0, 1, 3).reshape(seq, batch, heads * value_layer.shape[-1])

    def _attend(self, q, k, v, mask_type: str) -> torch.Tensor:
        """SDPA on [b, heads, s, d]; query head i reads key/value group i // (heads / groups)."""
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=mask_type == "causal", scale=self.softmax_scale)

    def _packed(self, query, key, value, mask_type: str, cu_seqlens_q, cu_seqlens_kv) -> torch.Tensor:
        """thd: [t, heads, d] -> [t, heads * d], each cu_seqlens segment attending only to itself.
        TE's thd masks are `padding_causal` / `padding` (megatron-core maps causal / no_mask to them)."""
        causal = {"padding_causal": "causal", "causal": "causal", "padding": "no_mask", "no_mask": "no_mask"}
        if mask_type not in causal:
            raise NotImplementedError(f"attn_mask_type={mask_type!r} with qkv_format='thd'")
        if cu_seqlens_q is None or cu_seqlens_kv is None or not torch.equal(cu_seqlens_q, cu_seqlens_kv):
            raise NotImplementedError("thd self-attention needs cu_seqlens_q == cu_seqlens_kv")
        bounds = cu_seqlens_q.tolist()
        cp = 1 if self.cp_group is None else dist.get_world_size(self.cp_group)
        if bounds[0] != 0 or bounds[-1] != query.shape[0] * cp:
            raise ValueError(f"cu_seqlens {bounds} do not cover the {query.shape[0]} x {cp} packed tokens")
        if self.cp_group is not None:
            segments = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
            out = self._context_parallel(
                query[:, None], key[:, None], value[:, None], segments, causal[mask_type] == "causal"
            )
            return out.reshape(query.shape[0], -1)
        outs = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            q, k, v = (t[start:end].permute(1, 0, 2)[None] for t in (query, key, value))  # [1, h, n, d]
            outs.append(self._attend(q, k, v, causal[mask_type])[0].permute(1, 0, 2))  # [n, h, d]
        return torch.cat(outs).reshape(query.shape[0], -1)

    def _context_parallel(self, query, key, value, segments: list[int], causal: bool) -> torch.Tensor:
        """[s_local, b, heads, d] local queries against keys and values gathered over the CP group;
        `segments`: the whole sequence's (one, or the thd cu_seqlens'); a query reads keys of its own
        segment (at or before its position when causal). Returns [s_local, b, heads, v_d]."""
        split = ContextSplit(self.cp_group, segments, query.device)
        key, value = (split.gather(t, dim=0, sum_grads=True) for t in (key, value))
        segment_of = torch.repeat_interleave(torch.arange(len(segments)), torch.tensor(segments)).to(query.device)
        q_pos, k_pos = split.index, torch.arange(split.total, device=query.device)
        allowed = segment_of[q_pos][:, None] == segment_of[k_pos][None, :]
        if causal:
            allowed &= k_pos[None, :] <= q_pos[:, None]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3)


def _device(device):
    """Megatron asks for `torch.cuda.current_device()` without use_cpu_initialization: the CPU here."""
    return "cpu" if device is None or str(device).startswith("cuda") or isinstance(device, int) else device
