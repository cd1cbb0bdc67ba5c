"""Streaming export: a running Megatron world -> `(hf_name, full tensor)` in HF checkpoint naming.

`plan(model, bridge)` lists one frozen task per local parameter of this rank's pipeline stage
(every Megatron parameter must have a mapping: ValueError naming it otherwise).
`export_hf_weights(model, bridge, bucket_bytes)` walks the plan bucket by bucket: it gathers
each parameter over TP (ETP for experts), then EP (global expert = local + ep_rank *
experts_per_rank), converts it to HF tensors with the global layer index, drops vocab padding,
and yields them on the *source rank* of each stage: TP rank 0 / DP rank 0 / CP rank 0.

Only the source needs the tensors, so only the replica that holds it gathers: a parameter is
gathered by the TP group of DP rank 0 / CP rank 0 (experts: the ETP and EP groups of expert-DP
rank 0), into the group's first member (TP/ETP point-to-point, `gathers.gather_to_first`; EP
one `gather` collective per parameter, `gathers.gather_members`); the other data-parallel
replicas skip it. The source is the first member of each of its groups.

FP8 rollout weights (`fp8`): quantized where each weight lives, before any gather crosses a link
(`mappings.Mapping.export`); nothing after the export (funnel, buckets, broadcast) quantizes.
Delta sync (`owner`, `mappings.OwnerDiffs`): each expert owner may turn its experts (after the
HF conversion and FP8) into payloads before the EP gather, which then carries those; every other
parameter is gathered to its diff owner among the TP members (`diff_owners`: balanced by bytes),
which diffs it and hands the payloads to the source (`mappings.Mapping.export`).

Lockstep: the collectives of a task run inside TP, ETP and EP groups, whose members all sit in
the same pipeline stage and hold the same list of local parameters (same chunks and layers,
same number of local experts), so every member walks the same plan and no placeholders are needed; stages
never talk to each other (each yields its own layers). Every rank of the world must exhaust
the generator; non-source ranks receive nothing.

Memory: beyond the model, at most one bucket of gathered tensors (`bucket_bytes`, or one
parameter's tensors if that is larger) is alive inside the generator at a time; each item is
released by the generator once yielded, so a consumer that drops items keeps that bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from parallel.bridges import Bridge
from parallel.context import parallel_context, uses_transformer_engine
from parallel.fp8 import BlockFP8
from parallel.hf_checkpoint import finalize_hf_checkpoint, write_shards
from parallel.lora import adapter_parameters, adapters
from parallel.mappings import Mapping, OwnerDiffs, ParallelContext, resolve
from parallel.staging import fresh_staging, staging_dir

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024


def is_export_source() -> bool:
    """True on the rank that receives this stage's exported tensors (TP0 / DP0 / CP0)."""
    # heavy: megatron-core, loaded only where a model is built (after parallel.cpu_compat.apply)
    from megatron.core import parallel_state as ps

    return (
        ps.get_tensor_model_parallel_rank() == 0
        and ps.get_data_parallel_rank() == 0
        and ps.get_context_parallel_rank() == 0
    )


def export_source_ranks() -> dict[int, int]:
    """{pipeline stage: global rank that yields its tensors}. Collective: every rank calls it."""
    # heavy: megatron-core, loaded only where a model is built (after parallel.cpu_compat.apply)
    from megatron.core import parallel_state as ps

    mine = (ps.get_pipeline_model_parallel_rank(), dist.get_rank()) if is_export_source() else None
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return dict(sorted(item for item in everyone if item is not None))


def model_tensors(model) -> dict[str, torch.Tensor]:
    """Parameters plus persistent buffers (e.g. the router's `expert_bias`): what an HF checkpoint
    holds. LoRA adapters are not among them (parallel.peft exports them; merged exports add them)."""
    persistent = model.state_dict(keep_vars=True)
    adapter = adapter_parameters(model)
    tensors = {name: p for name, p in model.named_parameters() if name not in adapter}
    tensors.update((name, b) for name, b in model.named_buffers() if name in persistent)
    return tensors


@dataclass(frozen=True)
class ExportTask:
    """One local Megatron parameter: its mapping, indices and the bytes it gathers to."""

    name: str
    mapping: Mapping
    indices: tuple[int, ...]
    gathered_bytes: int


def plan(model, bridge: Bridge, ctx: ParallelContext | None = None) -> tuple[ExportTask, ...]:
    """The export tasks of this rank, in `model_tensors` order (identical on every member
    of a TP/ETP/EP group). Local, no collective."""
    ctx = ctx or parallel_context(model, bridge)
    table = bridge.mappings(te=uses_transformer_engine(model))
    tasks = []
    for name, param in model_tensors(model).items():
        mapping, indices = resolve(table, name)
        if not mapping.exported:
            continue
        axis = mapping.axis(ctx)
        copies = axis.size * (ctx.ep.size if mapping.expert else 1)
        tasks.append(ExportTask(name, mapping, indices, param.numel() * param.element_size() * copies))
    return tuple(tasks)


def diff_owners(tasks: tuple[ExportTask, ...], tp_size: int) -> dict[str, int]:
    """{non-expert task name: the TP member that gathers and diffs it} with owner-side diffs: each
    task in plan order to the member with the fewest gathered bytes so far (the lowest on a tie),
    so every member compares and keeps about 1/tp of the stage's dense bytes. The same
    on every member (a function of the plan). Experts: their owners diff them (`sync.owner`)."""
    load = [0] * tp_size
    owners = {}
    for task in tasks:
        if not task.mapping.expert:
            owners[task.name] = member = load.index(min(load))
            load[member] += task.gathered_bytes
    return owners


def buckets(tasks: tuple[ExportTask, ...], bucket_bytes: int) -> Iterator[list[ExportTask]]:
    """Consecutive tasks whose gathered size fits in `bucket_bytes` (a larger task goes alone)."""
    bucket: list[ExportTask] = []
    size = 0
    for task in tasks:
        if bucket and size + task.gathered_bytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append(task)
        size += task.gathered_bytes
    if bucket:
        yield bucket


def model_chunks(model) -> list:
    """A model or, under virtual pipeline parallelism, the list of this rank's chunks."""
    return list(model) if isinstance(model, (list, tuple)) else [model]


def export_hf_weights(
    model,
    bridge: Bridge,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    merge_adapters: bool = True,
    fp8: BlockFP8 | None = None,
    owner: OwnerDiffs | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, tensor)` for this stage's parameters on the source rank. `model` is
    a GPTModel or the list of virtual-pipeline chunks (each numbers its layers globally, so
    every chunk exports under its own layer offset, in chunk order).

    Collective: every rank of the world iterates it to the end (see the module docstring).
    LoRA adapters (parallel.lora) are merged into their base weights (`merge_adapters`), so
    engines without LoRA serve the policy; `merge_adapters=False` exports the frozen base.
    `fp8`: decoder linear weights as FP8 blocks + `*_scale_inv`, quantized on the owner's device
    (the bytes of `fp8.quantize_stream` over the full-precision export).
    `owner`: owner-side diffs (`parallel.mappings.OwnerDiffs`, with `sync.delta`): when it
    encodes, every tensor is yielded as the payload its owner made (experts before the EP gather,
    the others on their TP diff owners, `diff_owners`); the source keeps none of them.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes}: must be positive")
    for chunk in model_chunks(model):
        yield from _export_chunk(chunk, bridge, bucket_bytes, merge_adapters, fp8, owner)


def _export_chunk(
    model, bridge: Bridge, bucket_bytes: int, merge_adapters: bool, fp8: BlockFP8 | None, owner: OwnerDiffs | None
) -> Iterator[tuple[str, torch.Tensor]]:
    ctx = parallel_context(model, bridge)
    params = model_tensors(model)
    lora = adapters(model) if merge_adapters else {}
    tasks = plan(model, bridge, ctx)
    owners = diff_owners(tasks, ctx.tp.size) if owner is not None else {}
    with torch.no_grad():
        for bucket in buckets(tasks, bucket_bytes):
            gathered: list[tuple[str, torch.Tensor]] = []
            for task in bucket:
                if ctx.in_expert_source_replica if task.mapping.expert else ctx.in_source_replica:
                    local = params[task.name]
                    if task.name in lora:  # this rank's shard of base + scale * B A, summed in fp32
                        local = (local.float() + lora[task.name].delta().float()).to(local.dtype)
                    gathered.extend(task.mapping.export(local, ctx, task.indices, fp8, owner, owners.get(task.name, 0)))
            gathered.reverse()
            while gathered:  # empty except on the source (the first member of all its groups)
                yield gathered.pop()


def save_hf_checkpoint(
    model,
    bridge: Bridge,
    out_dir,
    hf_config: dict,
    *,
    max_shard_bytes: int = 5 * 2**30,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    extra_files: dict[str, bytes] | None = None,
    progress=None,
    merge_adapters: bool = True,
    fp8: BlockFP8 | None = None,
) -> None:
    """Write the model as an HF checkpoint (safetensors shards + index + config) to `out_dir`,
    in the model's parameter dtype (config `dtype`; fp32 buffers such as routers' score biases stay fp32).
    `fp8`: decoder linear weights as block-scaled FP8 (`BlockFP8.quantize_stream`), the config
    saying so; otherwise full precision and no `quantization_config`, whatever was imported.

    Collective: every rank calls it. Each stage's source rank writes its own shards into
    `<out_dir>.tmp`; global rank 0 merges the index and renames the directory when complete.
    """
    # heavy: megatron-core, loaded only where a model is built (after parallel.cpu_compat.apply)
    from megatron.core import parallel_state as ps

    tmp = staging_dir(out_dir)
    if dist.get_rank() == 0:
        fresh_staging(out_dir)
    dist.barrier()
    prefix = f"stage{ps.get_pipeline_model_parallel_rank():03d}"
    items = export_hf_weights(model, bridge, bucket_bytes=bucket_bytes, merge_adapters=merge_adapters, fp8=fp8)
    weight_map = write_shards(items, tmp, prefix, max_shard_bytes, progress=progress)
    maps: list = [None] * dist.get_world_size()
    dist.all_gather_object(maps, weight_map)
    if dist.get_rank() == 0:
        merged = {name: file for part in maps for name, file in part.items()}
        config = {key: value for key, value in hf_config.items() if key != "quantization_config"}
        # the weights' dtype: transformers >= 4.56 reads `dtype`, older ones (engines') `torch_dtype`
        config["dtype"] = config["torch_dtype"] = str(model_chunks(model)[0].config.params_dtype).removeprefix("torch.")
        if fp8 is not None:
            config["quantization_config"] = fp8.hf_config()
        finalize_hf_checkpoint(tmp, out_dir, merged, config, extra_files=extra_files)
    dist.barrier()
