"""CPU compatibility layer: lets the real megatron-core run on CPU over gloo.

Megatron-core assumes CUDA. On a machine without a GPU (CI, laptops) this module patches
the few places where that assumption is hard-coded, so the *same* Megatron code paths
(TP/PP/EP/ETP, the MoE alltoall dispatcher, the 1F1B schedule, the distributed optimizer,
dist_checkpointing) run on CPU. It is not a second trainer.

`apply()` is idempotent and does nothing when CUDA is available. It must run before
megatron-core is imported (patch 0) and before any model is built. Each patch says what
fails without it and for which versions; `tests/parallel/test_cpu_compat.py` shows each
failure is gone. Verified with megatron-core 0.16.1 (Python 3.11) and 0.19.x (Python 3.12).
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import sys
import threading
import types

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

_applied = False


def needed() -> bool:
    return not torch.cuda.is_available()


def apply() -> None:
    """Apply every patch once, when CUDA is unavailable.

    The device-literal patch is a torch-function mode, and torch keeps modes per thread: a
    thread that calls Megatron (e.g. a Ray actor's executor thread) calls `apply()` itself; the
    other patches are process-wide and applied once.
    """
    global _applied
    if not needed():
        return
    _enter_device_mode_on_this_thread()
    if _applied:
        return
    _stub_triton_kernels()
    _cuda_runtime_as_noops()
    _cuda_rng_on_cpu_generator()
    _sequence_parallel_torch_norm()
    _alltoall_split_sizes_as_lists()
    _uneven_gather_and_reduce_scatter()
    _router_gating_without_te()
    _distributed_optimizer_checkpoint_without_te()
    _mla_without_te()
    _device_mode_in_recompute()
    _applied = True


# -- patch 0: triton kernel import (0.19.x) -------------------------------------------------
def _stub_triton_kernels() -> None:
    """0.19.x imports `transformer.moe.ops.paged_stash` (triton kernels) unconditionally, so
    `import megatron.core.transformer.moe` raises ModuleNotFoundError without triton. A stub
    module for that one kernel module fixes it; a fake top-level `triton` would break
    torch._inductor instead. The CPU path never calls those kernels."""
    try:
        import triton  # noqa: F401

        return
    except ImportError:
        pass
    name = "megatron.core.transformer.moe.ops.paged_stash"
    if name not in sys.modules:
        stub = types.ModuleType(name)
        stub.__spec__ = importlib.machinery.ModuleSpec(name, loader=None)
        stub.__getattr__ = _missing_kernel(name)
        sys.modules[name] = stub


def _missing_kernel(module: str):
    def getattr_(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _unavailable(f"{module}.{attr} (a triton kernel, GPU only)")

    return getattr_


def _unavailable(what: str):
    def fail(*args, **kwargs):
        raise RuntimeError(f"{what} is not available on CPU")

    return fail


# -- patch 1: CUDA streams, events, synchronize, current_device ------------------------------
class _NullEvent:
    """Stands in for torch.cuda.Event: on CPU every op is already complete when it returns."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass

    def wait(self, stream=None):
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.0


class _NullStream:
    """Stands in for torch.cuda.Stream: CPU ops run in program order on one stream."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event or _NullEvent()

    def synchronize(self):
        pass

    def query(self) -> bool:
        return True


_CURRENT_STREAM = _NullStream()


def _cuda_runtime_as_noops() -> None:
    """The MoE router and alltoall dispatcher, the optimizer and the schedules create side
    streams and events and call `torch.cuda.current_device()` / `synchronize()`; on a CPU
    build each raises "Torch not compiled with CUDA enabled" (all versions). Device index 0
    is returned and mapped to the CPU by patch 3."""
    cuda = torch.cuda
    cuda.Stream = _NullStream
    cuda.Event = _NullEvent
    cuda.current_stream = lambda device=None: _CURRENT_STREAM
    cuda.default_stream = lambda device=None: _CURRENT_STREAM
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.synchronize = lambda device=None: None
    cuda.current_device = lambda: "cpu"
    cuda.set_device = lambda device: None
    cuda.device_count = lambda: 0
    cuda.empty_cache = lambda: None
    cuda.memory_allocated = lambda device=None: 0
    cuda.max_memory_allocated = lambda device=None: 0
    cuda.reset_peak_memory_stats = lambda device=None: None
    cuda.nvtx = types.SimpleNamespace(range_push=lambda *a, **k: None, range_pop=lambda *a, **k: None)


# -- patch 2: CUDA RNG -> the CPU generator ---------------------------------------------------
def _cuda_rng_on_cpu_generator() -> None:
    """Megatron's RNG tracker (`model_parallel_cuda_manual_seed`, `get_cuda_rng_tracker().fork()`
    used for dropout and TP-sharded init) reads and writes the CUDA generator; on CPU those
    calls raise or silently do nothing (all versions). The CPU generator plays its role, so
    forked streams and their checkpointed states behave as on GPU."""
    # megatron-core is patched here: imported inside each patch, after patch 0 (see apply)
    from megatron.core.tensor_parallel import random as mrandom

    def get_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    # torch.manual_seed itself calls torch.cuda.manual_seed_all: seed the generator directly
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    torch.cuda.get_rng_state_all = lambda: [torch.get_rng_state()]
    torch.cuda.set_rng_state_all = lambda states: torch.set_rng_state(states[0])


# -- patch 3: device="cuda" literals, .cuda(), 'torch.cuda.FloatTensor' checks --------------
def _is_cuda_device(device) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # a bare index means a CUDA device
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class CudaLiteralsToCpu(TorchFunctionMode):
    """A torch-function mode that sends tensors meant for "the GPU" to the CPU.

    Megatron creates tensors with `device="cuda"` / `torch.cuda.current_device()` literals in
    the pipeline schedules and p2p communication, the optimizer, DDP grad buffers, clip_grads
    and the MoE dispatcher, calls `.cuda()` on optimizer state and checks
    `param.type() == 'torch.cuda.FloatTensor'` (all versions), and stages host tensors in pinned
    memory (`pin_memory=True`, which a CPU-only torch refuses: context parallelism's
    `get_pos_emb_on_this_cp_rank`). Rewriting the device at the torch-function boundary fixes every
    such site at once instead of copying each function.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


_threads_in_mode: set[int] = set()


def _enter_device_mode_on_this_thread() -> None:
    thread = threading.get_ident()
    if thread not in _threads_in_mode:
        CudaLiteralsToCpu().__enter__()  # stays on this thread's mode stack for its lifetime
        _threads_in_mode.add(thread)


# -- patch 4: norms under sequence parallel ---------------------------------------------------
def _sequence_parallel_torch_norm() -> None:
    """MoE with TP>1 requires sequence parallel, but the local spec's `WrappedTorchNorm` (used
    when Apex is absent) asserts `not config.sequence_parallel` (all versions). Its torch
    norm is correct under SP as long as the weight's grads are summed over TP, which Megatron
    does for params marked `.sequence_parallel = True` (as TE's norms are)."""
    # megatron-core is patched here: imported inside each patch, after patch 0 (see apply)
    from megatron.core.transformer import torch_norm

    def new(
        cls,
        config,
        hidden_size,
        eps=1e-5,
        persist_layer_norm=False,
        zero_centered_gamma=False,
        normalization="LayerNorm",
    ):
        if config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        elif config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        else:
            raise ValueError(f"normalization={config.normalization!r}: use LayerNorm or RMSNorm")
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm

    torch_norm.WrappedTorchNorm.__new__ = new


# -- patch 5: alltoall split sizes -------------------------------------------------------------
def _alltoall_split_sizes_as_lists() -> None:
    """The alltoall dispatcher turns split sizes into numpy arrays via
    `maybe_move_tensor_to_cpu(..., as_numpy=True)`, but only for CUDA tensors; on CPU they stay
    tensors, and gloo's `all_to_all_single` accepts neither tensors nor arrays as split sizes,
    only lists (all versions)."""
    # megatron-core is patched here: imported inside each patch, after patch 0 (see apply)
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    def to_host(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor):
            return tensor.numpy()
        return tensor

    moe_utils.maybe_move_tensor_to_cpu = to_host
    token_dispatcher.maybe_move_tensor_to_cpu = to_host


# -- patch 6: uneven all_gather / reduce_scatter on gloo --------------------------------------
def _uneven_gather_and_reduce_scatter() -> None:
    """With TP/SP the MoE dispatcher gathers and reduce-scatters tokens with per-rank split
    sizes; gloo implements neither uneven `all_gather` nor `reduce_scatter` (all versions).
    Gather pads every rank to the largest split; reduce-scatter all-reduces and keeps this
    rank's slice (more bytes moved, same result). Equal splits keep Megatron's path."""
    # megatron-core is patched here: imported inside each patch, after patch 0 (see apply)
    from megatron.core.tensor_parallel import mappings

    original_gather = mappings._gather_along_first_dim

    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return original_gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(s) for s in output_split_sizes]
        longest = max(sizes)
        padded = input_.new_zeros((longest, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        pieces = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(pieces, padded.contiguous(), group=group)
        return torch.cat([piece[:size] for piece, size in zip(pieces, sizes)], dim=0)

    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        if group.size() == 1:
            return input_
        total = input_.contiguous().clone()
        dist.all_reduce(total, group=group)
        if input_split_sizes is None:
            return total.chunk(group.size(), dim=0)[group.rank()].contiguous()
        sizes = [int(s) for s in input_split_sizes]
        start = sum(sizes[: group.rank()])
        return total[start : start + sizes[group.rank()]].contiguous()

    mappings._gather_along_first_dim = gather
    mappings._reduce_scatter_along_first_dim = reduce_scatter


# -- patch 7: router gating without Transformer Engine (0.16.1) -------------------------------
def _router_gating_without_te() -> None:
    """0.16.1's `RouterGatingLinearFunction` tests `te_general_gemm is not None`, but the name is
    only defined when Transformer Engine imports: NameError on the first MoE forward without
    TE. Defining it as None selects the plain torch matmul. Fixed upstream in 0.17."""
    # megatron-core is patched here: imported inside each patch, after patch 0 (see apply)
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


# -- patch 8: distributed-optimizer checkpoints with torch's Adam (0.16.1, no Apex/TE) -------
def _distributed_optimizer_checkpoint_without_te() -> None:
    """Without Apex/TE the distributed optimizer wraps torch's Adam, and two of its checkpoint
    paths only work with TE's FusedAdam (0.16.1):
    - `state_dict()` asserts exactly one Adam `step` value, so describing a freshly built
      optimizer for a load (`sharded_state_dict(is_loading=True)`) fails: its state is created
      first with Megatron's own placeholder step, which the load then overwrites;
    - the `fully_reshardable` load copies every Adam state key, including `step`, which the
      checkpoint keeps in param_groups instead: KeyError. Only the saved keys are copied;
      `load_state_dict` restores `step` from param_groups;
    - that restore gives every parameter the *same* `step` tensor, which torch's Adam then
      increments in place once per parameter: every update after a resume uses a wrong bias
      correction. Each parameter gets its own copy.
    """
    # megatron-core is patched here: imported inside each patch, after patch 0 (see apply)
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    describe = DistributedOptimizer.sharded_state_dict

    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading=False, **kwargs):
        if is_loading and not self.optimizer.state:
            self._init_optimizer_states_with_dummy_values()
        return describe(self, model_sharded_state_dict or {}, is_loading, **kwargs)

    def set_states(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        destinations = {"param": main_param, **self.optimizer.state[main_param]}
        for key, tensor in tensors.items():
            destinations[key].copy_(tensor)

    load = DistributedOptimizer.load_state_dict

    def load_state_dict(self, state_dict):
        load(self, state_dict)
        for state in self.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()

    DistributedOptimizer.sharded_state_dict = sharded_state_dict
    if not _has_fused_adam():
        DistributedOptimizer._set_main_param_and_optimizer_states = set_states
        DistributedOptimizer.load_state_dict = load_state_dict


def _has_fused_adam() -> bool:
    # megatron-core is patched here: imported inside each patch, after patch 0 (see apply)
    from megatron.core.optimizer import distrib_optimizer

    return bool(getattr(distrib_optimizer, "HAVE_APEX_OR_TE", False))


# -- patch 9: Multi-Latent Attention without Transformer Engine (0.16.1) ----------------------
def _mla_without_te() -> None:
    """`megatron.core.extensions.transformer_engine` imports without TE and leaves MagicMock
    placeholders for its classes, so 0.16.1's `multi_latent_attention` sets `HAVE_TE = True`
    and then calls `isinstance(self.linear_proj, TELinear)` with a mock: TypeError when any
    MLA layer (DeepSeek-V3) is built without TE. `HAVE_TE = False` skips that fp8-only TE
    branch; the local spec's linears are picked as before."""
    try:
        import transformer_engine  # noqa: F401

        return
    except ImportError:
        pass
    # megatron-core is patched here: imported inside each patch, after patch 0 (see apply)
    from megatron.core.transformer import multi_latent_attention

    multi_latent_attention.HAVE_TE = False


# -- patch 10: activation recompute in backward ----------------------------------------------
def _device_mode_in_recompute() -> None:
    """Torch-function modes are off while autograd runs backward, so Megatron's activation
    recompute (`CheckpointFunction.backward` re-running the layer's forward) reaches the
    `device="cuda"` literal of `get_default_causal_mask` without patch 3: "Torch not compiled
    with CUDA enabled" with `recompute_granularity="full"` (all versions). The recompute runs
    inside the device mode."""
    # megatron-core is patched here: imported inside each patch, after patch 0 (see apply)
    from megatron.core.tensor_parallel.random import CheckpointFunction

    backward = CheckpointFunction.backward

    def backward_in_device_mode(ctx, *grads):
        with CudaLiteralsToCpu():
            return backward(ctx, *grads)

    CheckpointFunction.backward = staticmethod(backward_in_device_mode)
