"""LoRA on the Megatron model: one low-rank adapter per targeted linear, routed experts included.

`add_lora(model, bridge, config, seed)` gives every targeted linear of this rank's stage a
`LoRAAdapter`, registered next to it as `<name>_lora` (so the base parameters keep their names,
and the checkpoint and HF mappings stay as they are), and freezes every other parameter. The base
layer's output gains `scale * B(A(x))` through a forward hook. Routers are never adapted, so
routing replay means the same with and without LoRA. Routed experts get one adapter per expert,
living with their expert on its EP rank: SequentialMLP's `local_experts.{j}.linear_fc1_lora`, and
for TE's grouped experts (TEGroupedMLP) a `GroupedLoRA` `experts.linear_fc1_lora.{j}` that splits
the tokens like the grouped GEMM does (`m_splits`) and applies expert j's own adapter.

Both of megatron-core's layer specs are covered: the local spec (`ColumnParallelLinear`,
`RowParallelLinear`) and Transformer Engine's (`TEColumnParallelLinear`, `TERowParallelLinear`,
the grouped linears, and `TELayerNormColumnParallelLinear`, which fuses the preceding norm into
`linear_qkv` / dense `linear_fc1`: its adapter reads the normed input that TE returns with
`return_layernorm_output`, as Megatron-Bridge's LoRA does). TE linears do their tensor-parallel
communication inside, the local ones outside; either way the output the hook sees is the same.

Sharding follows the base layer (Megatron-Bridge's rule):
- column-parallel (`linear_qkv`, `linear_fc1`): A [r, in] is replicated, B [out / tp, r] is split
  on the output like the weight (for `linear_fc1` as [gate_r; up_r], like the weight);
- row-parallel (`linear_proj`, `linear_fc2`): A [r, in / tp] is split on the input, B [out, r]
  is replicated;
- duplicated (TE's `TELinear` of MLA's down projections, the same whole weight on every TP rank):
  A and B are whole and replicated. On the local spec those projections are column-parallel.
The low-rank activation `h` crosses the tensor-parallel group the way the base layer's does, so
only r-wide tensors are communicated. Where each rank's gradient of a replicated A or B is
partial (a sequence-parallel shard of tokens, or an expert-TP rank whose partial outputs the token
dispatcher sums), `_SumGrad` all-reduces it in backward, so the gradients equal those on one rank.

Initialisation is layout-independent: A is PEFT's Kaiming-uniform, drawn whole from a generator
seeded by (seed, the HF name of the base weight) and sliced to this rank's shard; B is zero.
"""

from __future__ import annotations

import hashlib
import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel.context import parallel_context, uses_transformer_engine
from parallel.mappings import resolve

MLA_TARGETS = ("linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj")
"""Multi-Latent Attention's input projections (DeepSeek-V3): q_proj (no q LoRA) or q_a_proj and
q_b_proj, kv_a_proj_with_mqa, kv_b_proj; MLA models have these instead of `linear_qkv`."""
TARGETS = ("linear_qkv", *MLA_TARGETS, "linear_proj", "linear_fc1", "linear_fc2")
"""Megatron module names LoRA can target; each matches attention (qkv or MLA's projections, proj),
dense MLPs, shared experts and routed experts (fc1, fc2) alike."""

SUFFIX = "_lora"
"""The adapter of module `<parent>.<name>` is `<parent>.<name>_lora`."""


@dataclass(kw_only=True)
class LoRAConfig:
    """Adapter-only training: the base model is frozen, only the adapters learn."""

    config_name = "lora"

    rank: int = 8
    """r: rank of every adapter (rank 1-8 matches full fine-tuning for policy-gradient RL when
    every layer is adapted; use an LR about 10x the full fine-tuning one)."""
    alpha: float = 16.0
    """Scaling numerator: the update is (alpha / rank) * B A."""
    target_modules: list[str] | None = None
    """Megatron modules to adapt, from `TARGETS`: linear_qkv or MLA's projections and linear_proj
    (attention), linear_fc1, linear_fc2 (dense MLPs, shared experts and every routed expert).
    None (default): every one of them the model has. A name given here that no layer has is an
    error."""
    dropout: float = 0.0
    """Must be 0: the trainer's logprobs must equal the engine's."""
    use_rslora: bool = False
    """rsLoRA scaling alpha / sqrt(rank). SGLang ignores `use_rslora`, so adapters are exported with
    lora_alpha = alpha * sqrt(rank) and plain scaling: the same update."""

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"lora.rank={self.rank}: must be >= 1")
        if self.alpha <= 0:
            raise ValueError(f"lora.alpha={self.alpha}: must be > 0")
        if self.target_modules is not None:
            unknown = sorted(set(self.target_modules) - set(TARGETS))
            if unknown or not self.target_modules:
                raise ValueError(
                    f"lora.target_modules={self.target_modules}: choose a non-empty subset of {list(TARGETS)}, "
                    "or null for all the model has"
                )
        if self.dropout != 0.0:
            raise ValueError(
                f"lora.dropout={self.dropout}: must be 0 (RL needs the trainer's logprobs to equal "
                f"the engine's, which applies no dropout)"
            )

    @property
    def targets(self) -> tuple[str, ...]:
        """The Megatron module names to adapt where the model has them."""
        return TARGETS if self.target_modules is None else tuple(self.target_modules)

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @property
    def export_alpha(self) -> float:
        """`lora_alpha` of the exported PEFT config, whose scaling is always alpha / r."""
        return self.scale * self.rank


class _SumGrad(torch.autograd.Function):
    """Identity on a replicated weight whose per-rank gradient is partial: all-reduces it."""

    @staticmethod
    def forward(ctx, weight, group):
        ctx.group = group
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _summed(weight: torch.Tensor, group, size: int) -> torch.Tensor:
    return weight if size == 1 else _SumGrad.apply(weight, group)


class LoRAAdapter(torch.nn.Module):
    """`scale * B(A(x))` for one Megatron linear (`column`: column-parallel, else row-parallel).

    `weight` is the base's weight on this rank, `expert` says whether it is a routed expert's (the
    bridge's mapping knows), `config` is the layer's TransformerConfig: the same for every linear
    type. `lora_A` / `lora_B` are this rank's shards, sized and sharded like the base (module
    docstring).
    """

    def __init__(
        self,
        weight: torch.Tensor,
        *,
        column: bool,
        expert: bool,
        config,
        rank: int,
        scale: float,
        gated: bool,
        replicated: bool = False,
    ):
        super().__init__()
        # heavy: megatron-core, loaded only where a model is built (after parallel.cpu_compat.apply)
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        out_local, in_local = weight.shape
        self.column, self.scale, self.gated, self.replicated = column, scale, gated, replicated
        # The groups every megatron-core linear defaults to; derived, not read from the base,
        # because TE linears keep no group when the dispatcher does their communication.
        self.group = ps.get_expert_tensor_parallel_group() if expert else ps.get_tensor_model_parallel_group()
        self.group_size = dist.get_world_size(self.group)
        self.sequence_parallel = bool(config.sequence_parallel) and self.group_size > 1
        # megatron-core's rule for an expert linear whose TP/EP traffic the token dispatcher does.
        self.explicit_expert_comm = expert and (self.group_size > 1 or config.expert_model_parallel_size > 1)
        device, dtype = weight.device, weight.dtype
        self.lora_A = torch.nn.Parameter(torch.empty(rank, in_local, device=device, dtype=dtype))
        self.lora_B = torch.nn.Parameter(torch.zeros(out_local, rank, device=device, dtype=dtype))
        # Megatron's grad norm counts a tensor-parallel param on every rank, any other on dense-TP
        # rank 0 only, and never a `shared` one.
        if replicated:  # a duplicated linear (TE's MLA down projections): nothing is split
            for param in (self.lora_A, self.lora_B):
                set_tensor_model_parallel_attributes(param, False, 0, 1)
            return
        split, replicated = (self.lora_B, self.lora_A) if column else (self.lora_A, self.lora_B)
        set_tensor_model_parallel_attributes(split, True, 0 if column else 1, 1)
        first = dist.get_rank(self.group) == 0
        if expert:
            # Replicated over the expert-TP group, which need not be the dense TP group: count it
            # once, on the group's first member.
            set_tensor_model_parallel_attributes(replicated, first, 1 if column else 0, 1)
            replicated.shared = not first
            for param in (self.lora_A, self.lora_B):
                param.allreduce = False  # expert-data-parallel, like the expert weights
        else:
            set_tensor_model_parallel_attributes(replicated, False, 1 if column else 0, 1)

    enabled = True  # False inside `adapters_disabled`: the hook adds nothing

    def delta(self) -> torch.Tensor:
        """`scale * B @ A` on this rank's shard: what merging adds to the base weight's shard."""
        return self.scale * (self.lora_B @ self.lora_A)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # heavy: megatron-core, loaded only where a model is built (after parallel.cpu_compat.apply)
        from megatron.core.tensor_parallel import mappings

        group, size = self.group, self.group_size
        if self.replicated:  # every rank computes the whole output for its own tokens (SP) or all
            if not self.sequence_parallel:
                return self.scale * (x @ self.lora_A.t() @ self.lora_B.t())
            return self.scale * (x @ _summed(self.lora_A, group, size).t() @ _summed(self.lora_B, group, size).t())
        if self.column:  # x: the base's input, whole features (sequence-sharded under SP)
            if self.explicit_expert_comm:  # the dispatcher sums each ETP rank's partial dx
                h = x @ _summed(self.lora_A, group, size).t()
            elif self.sequence_parallel:
                h = x @ _summed(self.lora_A, group, size).t()
                h = mappings.gather_from_sequence_parallel_region(h, group=group)
            else:
                h = mappings.copy_to_tensor_model_parallel_region(x @ self.lora_A.t(), group=group)
            return self.scale * (h @ self.lora_B.t())
        h = x @ self.lora_A.t()  # x: this rank's input features; h: a partial sum over TP
        if self.explicit_expert_comm:  # partial outputs, summed by the dispatcher like the base's
            return self.scale * (h @ _summed(self.lora_B, group, size).t())
        if self.sequence_parallel:
            h = mappings.reduce_scatter_to_sequence_parallel_region(h, group=group)
            return self.scale * (h @ _summed(self.lora_B, group, size).t())
        h = mappings.reduce_from_tensor_model_parallel_region(h, group=group)
        return self.scale * (h @ self.lora_B.t())

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Checkpoint tensors by global shape, like the base weight (fc1's B as gate and up halves)."""
        # heavy: megatron-core, loaded only where a model is built (after parallel.cpu_compat.apply)
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        state = make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            {} if self.replicated else {"lora_B": 0} if self.column else {"lora_A": 1},
            sharded_offsets,
            tp_group=self.group,
            dp_cp_group=metadata["dp_cp_group"],
        )
        if self.gated:
            key = f"{prefix}lora_B"
            state[key] = apply_swiglu_sharded_factory(
                state[key], sharded_offsets, metadata.get("singleton_local_shards", False)
            )
        return state


class GroupedLoRA(torch.nn.ModuleList):
    """The adapters of a TE grouped linear (TEGroupedMLP's `linear_fc1` / `linear_fc2`): adapter j
    belongs to `weight{j}`, local expert j, as SequentialMLP's expert j has its own."""

    enabled = True  # False inside `adapters_disabled`

    def forward(self, x: torch.Tensor, m_splits: list[int]) -> torch.Tensor:
        # The grouped GEMM's tokens come sorted by local expert, m_splits[j] of them for expert j.
        return torch.cat([adapter(tokens) for adapter, tokens in zip(self, torch.split(x, list(m_splits)))])

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Keys and global expert offsets of SequentialMLP's per-expert adapters (as TEGroupedMLP
        does for its weights), so checkpoints move between the two."""
        # heavy: megatron-core, loaded only where a model is built (after parallel.cpu_compat.apply)
        from megatron.core import parallel_state as ps
        from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding

        singleton = (metadata or {}).get("singleton_local_shards", False)
        local = len(self)
        first, total = ps.get_expert_model_parallel_rank() * local, ps.get_expert_model_parallel_world_size() * local
        state = {}
        for j, adapter in enumerate(self):
            offsets = sharded_offsets if singleton else (*sharded_offsets, (len(sharded_offsets), first + j, total))
            part = adapter.sharded_state_dict(f"{prefix}{j}.", offsets, metadata)
            replace_prefix_for_sharding(part, f"{prefix}{j}.", f"{first + j}.{prefix}" if singleton else prefix)
            for tensor in part.values():  # replicated over expert-data-parallel ranks only
                tensor.replica_id = (*tensor.replica_id[:2], ps.get_expert_data_parallel_rank())
            state.update(part)
        return state


def _hook(adapter: LoRAAdapter):
    """Plain linears: the adapter reads the base's input."""

    def hook(module, args, output):
        out, bias = output
        return (out + adapter(args[0]), bias) if adapter.enabled else output

    return hook


def _normed_input_hook(adapter: LoRAAdapter):
    """TELayerNormColumnParallelLinear with `return_layernorm_output`: the adapter reads the normed
    input, which megatron's wrapper returns as `((out, normed), None)`, or `(out, bias, normed)`
    when it returns the bias; the consumer gets the usual `(out, bias)`."""

    def hook(module, args, output):
        if len(output) == 3:
            out, bias, normed = output
        else:
            (out, normed), bias = output
        return (out + adapter(normed), bias) if adapter.enabled else (out, bias)

    return hook


def _grouped_hook(adapter: GroupedLoRA):
    """TE grouped linears: forward(x, m_splits)."""

    def hook(module, args, output):
        out, bias = output
        return (out + adapter(args[0], args[1]), bias) if adapter.enabled else output

    return hook


@dataclass(frozen=True)
class _Kind:
    """How to adapt one type of megatron-core linear."""

    column: bool
    fused_norm: bool = False
    grouped: bool = False
    replicated: bool = False


def _linear_kinds(te: bool) -> dict[type, _Kind]:
    # heavy: megatron-core, loaded only where a model is built (after parallel.cpu_compat.apply)
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    kinds = {ColumnParallelLinear: _Kind(column=True), RowParallelLinear: _Kind(column=False)}
    if te:  # without transformer_engine these names are placeholders, so only TE-spec models look
        # heavy: megatron-core, loaded only where a model is built (after parallel.cpu_compat.apply)
        from megatron.core.extensions import transformer_engine as te_ext

        te_kinds = {
            te_ext.TELayerNormColumnParallelLinear: _Kind(column=True, fused_norm=True),
            te_ext.TEColumnParallelLinear: _Kind(column=True),
            te_ext.TERowParallelLinear: _Kind(column=False),
            te_ext.TEColumnParallelGroupedLinear: _Kind(column=True, grouped=True),  # None before TE 1.9
            te_ext.TERowParallelGroupedLinear: _Kind(column=False, grouped=True),
            # the parallel linears subclass it: last, so they match first (MLA's duplicated down projections)
            te_ext.TELinear: _Kind(column=True, replicated=True),
        }
        kinds.update((cls, kind) for cls, kind in te_kinds.items() if cls is not None)
    return kinds


def _kind_of(module, kinds: dict[type, _Kind]) -> _Kind | None:
    return next((kind for cls, kind in kinds.items() if isinstance(module, cls)), None)


def _seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")


def _init_a(adapter: LoRAAdapter, hf_name: str, seed: int, shard: tuple[int, int]) -> None:
    """PEFT's kaiming_uniform_(a=sqrt(5)) over the whole A, then this rank's columns."""
    rank, in_local = adapter.lora_A.shape
    index, count = shard
    fan_in = in_local * count
    bound = 1.0 / math.sqrt(fan_in)
    generator = torch.Generator().manual_seed(_seed(seed, hf_name))
    full = (torch.rand(rank, fan_in, generator=generator, dtype=torch.float64) * 2 - 1) * bound
    with torch.no_grad():
        adapter.lora_A.copy_(full[:, index * in_local : (index + 1) * in_local])


def adapters(model) -> dict[str, LoRAAdapter]:
    """{name of the base weight: its adapter} for this stage (empty without LoRA); a grouped
    linear's `weight{j}` has adapter j of its GroupedLoRA."""
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, GroupedLoRA):
            found.update((f"{name[: -len(SUFFIX)]}.weight{j}", adapter) for j, adapter in enumerate(module))
        elif isinstance(module, LoRAAdapter) and name.endswith(SUFFIX):
            found[name[: -len(SUFFIX)] + ".weight"] = module
    return found


@contextmanager
def adapters_disabled(model):
    """Run `model` as its frozen base: every adapter's hook adds nothing until the block ends
    (PEFT's `disable_adapter`). The KL reference of a LoRA run is this: no second model."""
    modules = [m for m in model.modules() if isinstance(m, (LoRAAdapter, GroupedLoRA))]
    for module in modules:
        module.enabled = False
    try:
        yield
    finally:
        for module in modules:
            module.enabled = True


def adapter_parameters(model) -> dict[str, torch.nn.Parameter]:
    """The trainable adapter parameters of this stage, by Megatron name."""
    mine = {id(p) for adapter in adapters(model).values() for p in adapter.parameters()}
    return {name: p for name, p in model.named_parameters() if id(p) in mine}


def adapter_sharded_state_dict(model) -> dict:
    """The entries of `model.sharded_state_dict()` that hold adapters: an adapter-only checkpoint."""
    trainable = {id(p) for p in adapter_parameters(model).values()}
    return {k: v for k, v in model.sharded_state_dict().items() if id(getattr(v, "data", None)) in trainable}


def add_lora(model, bridge, config: LoRAConfig, seed: int) -> dict[str, LoRAAdapter]:
    """Adapt every targeted linear of this stage and freeze everything else; returns `adapters(model)`.

    Works on the local and the Transformer Engine layer spec alike. Call before wrapping the model
    in DDP (which then only sees the adapters' gradients)."""
    te = uses_transformer_engine(model)
    kinds = _linear_kinds(te)
    ctx = parallel_context(model, bridge)
    table = bridge.mappings(te=te)
    for param in model.parameters():
        param.requires_grad_(False)
    found: set[str] = set()
    for name, module in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        kind = _kind_of(module, kinds)
        # MTP layers keep their base weights: PEFT's model (transformers') has no MTP layer to adapt
        if leaf not in config.targets or kind is None or name.startswith("mtp."):
            continue
        weights = [f"weight{j}" for j in range(module.num_gemms)] if kind.grouped else ["weight"]
        made = []
        for weight in weights:
            mapping, indices = resolve(table, f"{name}.{weight}")
            adapter = LoRAAdapter(
                getattr(module, weight),
                column=kind.column,
                expert=mapping.expert,
                config=module.config,
                rank=config.rank,
                scale=config.scale,
                gated=leaf == "linear_fc1",
                replicated=kind.replicated,
            )
            axis = mapping.axis(ctx)
            _init_a(adapter, mapping.hf_names(ctx, indices)[0], seed, (0, 1) if kind.column else (axis.rank, axis.size))
            made.append(adapter)
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        if kind.grouped:
            grouped = GroupedLoRA(made)
            parent.add_module(leaf + SUFFIX, grouped)
            module.register_forward_hook(_grouped_hook(grouped))
        else:
            parent.add_module(leaf + SUFFIX, made[0])
            if kind.fused_norm:
                # TE fuses the norm into this GEMM; the adapter must see the normed input, which TE
                # returns alongside its output (this rank's tokens: the adapter gathers r-wide h).
                module.return_layernorm_output, module.return_layernorm_output_gathered = True, False
                module.register_forward_hook(_normed_input_hook(made[0]))
            else:
                module.register_forward_hook(_hook(made[0]))
        found.add(leaf)
    missing = [t for t in config.target_modules or () if t not in found]
    if missing and len(model.decoder.layers):
        raise ValueError(
            f"lora.target_modules: {missing} match no layer of this model ({type(bridge).__name__}); remove them"
        )
    return adapters(model)
