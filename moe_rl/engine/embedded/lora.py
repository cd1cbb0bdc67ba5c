"""LoRA adapters (PEFT format) for the embedded engine, applied per request.

An adapter directory holds `adapter_config.json` (`r`, `lora_alpha`, `target_modules`, optional
`use_rslora`) and `adapter_model.safetensors` with PEFT names
`base_model.model.<module>.lora_A.weight` [r, in] / `.lora_B.weight` [out, r]. Each target must be
an `nn.Linear` of the model (attention projections, dense MLPs, shared experts); transformers fuses
routed experts into 3-D parameters, which PEFT's Linear LoRA does not target either.

Adapters are not merged: a forward hook on each target adds `scale * B(A(x))` to the rows of the
batch whose request named that adapter (`lora_path` in `/generate`, SGLang's field), so requests with
different adapters, or none, share one batch.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file

_PREFIX = "base_model.model."


class LoraAdapter:
    def __init__(self, name: str, path: str | Path):
        path = Path(path)
        config_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
        if not config_file.is_file() or not weights_file.is_file():
            raise ValueError(
                f"lora_path: {path} needs adapter_config.json and adapter_model.safetensors (PEFT save_pretrained)"
            )
        config = json.loads(config_file.read_text())
        rank = int(config["r"])
        alpha = float(config.get("lora_alpha", rank))
        self.name = name
        self.scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        self.weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        tensors = load_file(str(weights_file))
        for key, a in tensors.items():
            if not key.endswith(".lora_A.weight"):
                continue
            module = key[len(_PREFIX):] if key.startswith(_PREFIX) else key
            module = module[: -len(".lora_A.weight")]
            b = tensors.get(key.replace(".lora_A.", ".lora_B."))
            if b is None:
                raise ValueError(f"lora_path: {weights_file} has {key} but no matching lora_B")
            self.weights[module] = (a.float(), b.float())
        if not self.weights:
            raise ValueError(f"lora_path: {weights_file} holds no lora_A/lora_B weights")


class LoraSet:
    """The loaded adapters and which adapter each row of the next forward uses."""

    def __init__(self):
        self.adapters: dict[str, LoraAdapter] = {}
        self.row_adapters: list[str | None] = []

    def add(self, adapter: LoraAdapter, model: torch.nn.Module) -> None:
        modules = dict(model.named_modules())
        for target, (a, b) in adapter.weights.items():
            module = modules.get(target)
            if not isinstance(module, torch.nn.Linear):
                raise ValueError(f"lora_path: target {target!r} is not an nn.Linear of this model")
            if a.shape[1] != module.in_features or b.shape[0] != module.out_features:
                raise ValueError(f"lora_path: {target} lora_A/lora_B shapes do not fit {module}")
        self.adapters[adapter.name] = adapter

    def install(self, model: torch.nn.Module) -> list:
        """Hooks on every nn.Linear that some adapter targets (called again after a weight swap)."""
        targets = {t for adapter in self.adapters.values() for t in adapter.weights}
        return [
            module.register_forward_hook(self._hook(name))
            for name, module in model.named_modules()
            if name in targets
        ]

    def _hook(self, target: str):
        def hook(module, args, output):
            x = args[0]
            for name in {n for n in self.row_adapters if n is not None}:
                weights = self.adapters[name].weights.get(target)
                if weights is None:
                    continue
                rows = torch.tensor([n == name for n in self.row_adapters])
                a, b = weights
                output[rows] += self.adapters[name].scale * (x[rows] @ a.T @ b.T)
            return output

        return hook
