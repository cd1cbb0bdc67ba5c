"""LoRA adapters <-> the HF PEFT format that SGLang, vLLM and PEFT load.

An adapter directory holds `adapter_config.json` and `adapter_model.safetensors` with
`base_model.model.<HF module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r] for every
adapted HF linear: `q_proj/k_proj/v_proj/o_proj`, dense and shared-expert MLPs, and routed experts
one adapter per expert (`mlp.experts.{e}.gate_proj/up_proj/down_proj`, the per-expert format of
SGLang, vLLM and PEFT's transformers-5 loader).

The bridge's mapping of the base weight tells how an adapter maps, so no table is repeated here:
- column-parallel bases (QKV, gated fc1, plain columns): rows of the update B A are rows of B, so
  B goes through the base's own mapping (gathered over TP, split into q/k/v or gate/up) and the
  shared A is written once per HF target (fused `linear_qkv` / `linear_fc1` become separate
  targets with A duplicated);
- row-parallel bases: columns of B A are columns of A, so A goes through the base's mapping and
  the replicated B is written once;
- duplicated bases (the TE spec's MLA down projections): B goes through the base's mapping as for
  a column, which gathers nothing.
Experts are gathered over EP as their weights are; the TE spec's grouped experts (`weight{j}`)
map to the same per-expert HF names as SequentialMLP's. Import is the inverse (each rank reads its
shards); it refuses an adapter whose fused targets have different A (q/k/v, gate/up), which one
Megatron adapter cannot hold.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from parallel.bridges import Bridge
from parallel.context import parallel_context, uses_transformer_engine
from parallel.export import model_chunks
from parallel.hf_checkpoint import HFCheckpointReader
from parallel.lora import LoRAAdapter, LoRAConfig, adapters
from parallel.mappings import ColumnParallel, GatedColumn, Mapping, Replicated, resolve
from parallel.staging import fresh_staging, publish

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."


class _Shared(Replicated):
    """A replicated adapter half: the same tensor under each of the base's HF names."""

    def to_hf(self, full, ctx):
        return [full] + [full.clone() for _ in self.hf[1:]]  # own storage each: safetensors refuses aliases

    def read_shard(self, reader, names, axis, local_shape):
        first = reader.read(names[0])
        for name in names[1:]:
            if not torch.equal(reader.read(name), first):
                raise ValueError(
                    f"adapter: {name} differs from {names[0]}; one Megatron adapter shares it "
                    f"across these fused targets, so they must be equal"
                )
        return first


def peft_name(hf_weight: str, half: str) -> str:
    """`model.layers.0.self_attn.q_proj.weight`, "A" -> PEFT's `base_model.model....q_proj.lora_A.weight`."""
    return f"{PREFIX}{hf_weight[: -len('.weight')]}.lora_{half}.weight"


def _is_column(mapping: Mapping) -> bool:
    return isinstance(mapping, GatedColumn) or (isinstance(mapping, ColumnParallel) and mapping.dim == 0)


def _halves(mapping: Mapping, adapter: LoRAAdapter) -> tuple[Mapping, Mapping]:
    """(mapping of A, mapping of B): one follows the base weight's mapping, the other is shared."""
    shared = _Shared(mapping.megatron, *mapping.hf, expert=mapping.expert)
    # a duplicated linear's B is whole on every rank, which its Replicated mapping says
    column = _is_column(mapping) or (adapter.replicated and isinstance(mapping, Replicated))
    if adapter.column != column:
        raise ValueError(f"{mapping}: the adapter's parallel kind does not match the bridge's mapping")
    return (shared, mapping) if adapter.column else (mapping, shared)


def _renamed(mapping: Mapping, half: str) -> Mapping:
    """`mapping` with its HF names turned into PEFT's names of the `half` ("A" or "B") tensor."""
    clone = object.__new__(type(mapping))
    clone.__dict__.update(mapping.__dict__)
    clone.hf = tuple(peft_name(name, half) for name in mapping.hf)
    return clone


def _tasks(model, bridge: Bridge):
    table = bridge.mappings(te=uses_transformer_engine(model))  # TE's grouped experts: `weight{j}` names
    for base_name, adapter in adapters(model).items():
        mapping, indices = resolve(table, base_name)
        mapping_a, mapping_b = _halves(mapping, adapter)
        yield indices, ((adapter.lora_A, _renamed(mapping_a, "A")), (adapter.lora_B, _renamed(mapping_b, "B")))


def export_adapter(model, bridge: Bridge) -> Iterator[tuple[str, torch.Tensor]]:
    """`(PEFT name, tensor)` of every adapter of this stage, on the stage's export source rank
    (TP0 / DP0 / CP0; see parallel.export). Collective like `export_hf_weights`: every rank
    iterates it to the end. Adapters are small: one is gathered at a time."""
    with torch.no_grad():
        for chunk in model_chunks(model):
            ctx = parallel_context(chunk, bridge)
            for indices, halves in _tasks(chunk, bridge):
                for param, mapping in halves:
                    if ctx.in_expert_source_replica if mapping.expert else ctx.in_source_replica:
                        yield from mapping.export(param.detach(), ctx, indices)


def hf_lora_targets(bridge: Bridge, target_modules: list[str]) -> list[str]:
    """The HF module names (e.g. q_proj, gate_proj; Mixtral's w1) that adapting these Megatron
    modules adapts, from the bridge's table: what engines are told to serve (`--lora-target-modules`)."""
    names = set()
    for mapping in bridge.mappings():
        leaf = mapping.megatron.rsplit(".", 2)
        if len(leaf) == 3 and leaf[1] in target_modules and leaf[2] == "weight":
            names.update(name.split(".")[-2] for name in mapping.hf)
    return sorted(names)


def adapter_config(lora: LoRAConfig, target_modules: list[str], base_model: str | None = None) -> dict:
    """`adapter_config.json` for SGLang / vLLM / PEFT: plain alpha / r scaling (rsLoRA folded in)."""
    return dict(
        peft_type="LORA",
        task_type="CAUSAL_LM",
        r=lora.rank,
        lora_alpha=lora.export_alpha,
        target_modules=target_modules,
        lora_dropout=0.0,
        bias="none",
        use_rslora=False,
        base_model_name_or_path=base_model,
        inference_mode=True,
    )


def collect_adapter(model, bridge: Bridge, lora: LoRAConfig) -> tuple[dict, dict[str, torch.Tensor]] | None:
    """(adapter_config, {PEFT name: tensor}) of the whole model on global rank 0, None elsewhere.
    Collective: stages' source ranks send their adapters to rank 0 (megabytes, not weights)."""
    local = {name: tensor.cpu() for name, tensor in export_adapter(model, bridge)}
    parts: list = [None] * dist.get_world_size()
    dist.gather_object(local, parts if dist.get_rank() == 0 else None, dst=0)
    if dist.get_rank() != 0:
        return None
    tensors = {name: tensor for part in parts for name, tensor in part.items()}
    return adapter_config(lora, hf_lora_targets(bridge, lora.targets)), tensors


def write_adapter(directory: str | os.PathLike, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """Write a PEFT adapter directory atomically: `.tmp-<name>` beside it, then renamed into place."""
    staging = fresh_staging(directory, hidden=True)
    save_file({name: t.contiguous() for name, t in sorted(tensors.items())}, str(staging / WEIGHTS_FILE))
    (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return publish(staging, directory)


def save_adapter(
    model, bridge: Bridge, lora: LoRAConfig, directory: str | os.PathLike, base_model: str | None = None
) -> None:
    """Write the model's adapters as a PEFT adapter directory (collective; rank 0 writes)."""
    collected = collect_adapter(model, bridge, lora)
    if collected is not None:
        config, tensors = collected
        write_adapter(directory, {**config, "base_model_name_or_path": base_model}, tensors)
    dist.barrier()


def read_adapter_config(directory: str | os.PathLike) -> dict:
    """The adapter's config, checked for what a Megatron adapter can hold."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file() or not (Path(directory) / WEIGHTS_FILE).is_file():
        raise ValueError(f"{directory}: a PEFT adapter needs {CONFIG_FILE} and {WEIGHTS_FILE} (save_pretrained)")
    config = json.loads(path.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type={config.get('peft_type')!r}; only LORA adapters load")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise ValueError(f"{path}: {key} is set; moe-rl adapters have one rank and alpha for every module")
    if config.get("target_parameters"):
        raise ValueError(
            f"{path}: target_parameters (PEFT's fused 3-D expert format) cannot be imported; "
            f"save the adapter in the per-expert format (mlp.experts.{{e}}.gate_proj ...)"
        )
    return config


def lora_config_of(directory: str | os.PathLike, target_modules: list[str] | None = None) -> LoRAConfig:
    """The LoRAConfig that holds this PEFT adapter (rank, alpha, rsLoRA)."""
    config = read_adapter_config(directory)
    extra = {} if target_modules is None else dict(target_modules=target_modules)
    return LoRAConfig(
        rank=int(config["r"]),
        alpha=float(config.get("lora_alpha", config["r"])),
        use_rslora=bool(config.get("use_rslora", False)),
        **extra,
    )


def load_adapter(model, bridge: Bridge, directory: str | os.PathLike) -> None:
    """Fill this rank's adapters from a PEFT adapter directory (collective: checks that every
    tensor of the file was used by some rank). The model's LoRAConfig must match the file's
    rank and scaling (`lora_config_of`)."""
    expected = lora_config_of(directory)
    for adapter in (a for chunk in model_chunks(model) for a in adapters(chunk).values()):
        if adapter.lora_A.shape[0] != expected.rank or not math.isclose(adapter.scale, expected.scale):
            raise ValueError(
                f"{directory}: r={expected.rank}, scale={expected.scale} but the model's adapters have "
                f"r={adapter.lora_A.shape[0]}, scale={adapter.scale}: set lora.rank and lora.alpha "
                f"(and use_rslora) to the adapter's"
            )
    reader = HFCheckpointReader(directory, single_file=WEIGHTS_FILE)
    used: set[str] = set()
    with torch.no_grad():
        for chunk in model_chunks(model):
            ctx = parallel_context(chunk, bridge)
            for indices, halves in _tasks(chunk, bridge):
                for param, mapping in halves:
                    param.copy_(mapping.load(reader, ctx, indices, param.shape).to(param.dtype))
                    used.update(mapping.hf_names(ctx, indices))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(used))
    unused = reader.names() - set().union(*map(set, everyone))
    if unused:
        raise ValueError(
            f"{directory}: {len(unused)} adapter tensors match no adapted module, e.g. "
            f"{sorted(unused)[:3]}; set lora.target_modules to cover them"
        )
