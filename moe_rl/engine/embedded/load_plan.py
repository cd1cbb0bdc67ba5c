"""Weight updates into the embedded engine's spare model as plain tensor copies.

transformers' converter (what `from_pretrained` runs) turns checkpoint tensors into the model's
parameters: per-expert tensors stacked into fused ones, tied weights, any transpose. Run on every
update it costs many times the copies it makes (5.5 against 0.4 ms a load for the async bench's
tiny Qwen3-MoE), and the weight sync's commit waits on it while generation is paused. `load_plan`
finds those copies once, by running the converter on a float64 copy of the model whose checkpoint
holds each element's own index; `load_with_plan` then makes them. A family whose converter
does more than stack and concatenate (a transpose, a split) keeps the converter; the runner also
checks the plan against the converter's result before it uses it (`ModelRunner._load`).
"""

from __future__ import annotations

import copy

import torch
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import convert_and_load_state_dict_in_model
from transformers.modeling_utils import LoadStateDictConfig

_EXACT = 2**53  # float64 holds every integer below it


def convert_into(model: torch.nn.Module, state: dict[str, torch.Tensor], dtype: torch.dtype):
    """transformers' converter: `state` (checkpoint names) into `model` in place; its load info."""
    config = LoadStateDictConfig(dtype=dtype, weight_mapping=get_model_conversion_mapping(model))
    with torch.no_grad():
        info, _ = convert_and_load_state_dict_in_model(model, state, config)
        model.tie_weights()  # the converter replaces parameters: tie them again, as from_pretrained does
    return info


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters (each tied one once) and floating-point buffers a checkpoint may fill."""
    buffers = {name: b for name, b in model.named_buffers() if b.is_floating_point()}
    return {**dict(model.named_parameters()), **buffers}


def load_plan(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, tuple[str, ...]]:
    """Per parameter or buffer of `model` that `state` (a full checkpoint) fills: the checkpoint
    tensors whose elements, flattened and concatenated in this order, are its own (per-expert
    tensors stacked into a fused one: one per expert). ValueError where the converter does more
    than that (a transpose, a split)."""
    names = list(state)
    sizes = torch.tensor([state[name].numel() for name in names])
    starts = torch.cumsum(sizes, 0) - sizes
    if int(sizes.sum()) >= _EXACT:
        raise ValueError(f"{int(sizes.sum())} checkpoint elements: float64 cannot tag each one exactly")
    tags = {
        name: torch.arange(int(start), int(start) + state[name].numel(), dtype=torch.float64).view(state[name].shape)
        for name, start in zip(names, starts)
    }
    tagged = copy.deepcopy(model).to(torch.float64)
    with torch.no_grad():
        for tensor in model_tensors(tagged).values():
            tensor.fill_(-1)  # what no checkpoint element reaches stays -1
    convert_into(tagged, tags, torch.float64)
    plan = {}
    for name, tensor in model_tensors(tagged).items():
        index = tensor.detach().reshape(-1)
        if bool((index == -1).all()):
            continue  # not from the checkpoint (rotary frequencies)
        owners = torch.searchsorted(starts, index.long(), right=True) - 1
        used = list(dict.fromkeys(owners.tolist()))  # the checkpoint tensors, in order of first use
        placed = torch.cat([torch.arange(int(starts[i]), int(starts[i] + sizes[i])) for i in used])
        if not torch.equal(placed.double(), index):
            raise ValueError(f"{name} is not its checkpoint tensors concatenated")
        plan[name] = tuple(names[i] for i in used)
    return plan


def load_with_plan(model: torch.nn.Module, state: dict[str, torch.Tensor], plan: dict[str, tuple[str, ...]]) -> None:
    """Copy `state` into `model`'s tensors in place, as `plan` says."""
    tensors = model_tensors(model)
    with torch.no_grad():
        for name, sources in plan.items():
            flat = [state[source].reshape(-1) for source in sources]
            tensors[name].view(-1).copy_(flat[0] if len(flat) == 1 else torch.cat(flat))
