"""The loaded LoRA adapters of the embedded engine and the forward hooks that apply them per row.

Adapters are never merged: every forward names the adapter of each batch row (`row_adapters`,
None = base model), so requests with different adapters, or none, share one batch.
- `nn.Linear` targets: a forward hook adds `B(A(x))` (scale folded into B) to the rows of that
  adapter.
- fused routed experts (`lora.ExpertsLora`): a forward hook recomputes the experts' output for the
  tokens of that adapter's rows only: for each expert, the tokens routed to it (the router's own
  `top_k_index`, so the routing captured for the response is the one used) run
  `down(act(gate) * up)` with the adapter's low-rank terms added to gate_up and down, weighted by
  the router's `top_k_weights` and summed, as transformers' eager experts forward does
  (`Qwen3MoeExperts`, `MixtralExperts`, `DeepseekV3Experts`, `Glm4MoeExperts` share that code).

Only the scheduler thread runs forwards and changes the set (`add`, `remove`, `install`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_rl.engine.embedded.lora import ExpertsLora, LoraAdapter


class LoraSet:
    """The loaded adapters by name and which adapter each row of the next forward uses."""

    def __init__(self):
        self.adapters: dict[str, LoraAdapter] = {}
        self.row_adapters: list[str | None] = []

    def add(self, adapter: LoraAdapter, model: torch.nn.Module) -> None:
        if adapter.name in self.adapters:
            raise ValueError(f"Failed to load LoRA adapter {adapter.name} because it is already loaded")
        adapter.bind(model)
        self.adapters[adapter.name] = adapter

    def remove(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise ValueError(f"LoRA with name {name} does not exist. Loaded LoRAs: {sorted(self.adapters)}")

    def install(self, model: torch.nn.Module) -> list:
        """Hooks on every module some adapter targets (called again after a weight swap)."""
        linear = {t for adapter in self.adapters.values() for t in adapter.linear}
        experts = {t for adapter in self.adapters.values() for t in adapter.experts}
        hooks = []
        for name, module in model.named_modules():
            if name in linear:
                hooks.append(module.register_forward_hook(self._linear_hook(name)))
            elif name in experts:
                hooks.append(module.register_forward_hook(self._experts_hook(name), with_kwargs=True))
        return hooks

    def _tokens(self, name: str, num_tokens: int) -> torch.Tensor:
        """Bool mask over the first dim of a hooked input ([B, ...] or flattened [B*S, ...])."""
        rows = torch.tensor([n == name for n in self.row_adapters])
        return rows if num_tokens == len(rows) else rows.repeat_interleave(num_tokens // len(rows))

    def _active(self) -> set[str]:
        return {n for n in self.row_adapters if n is not None}

    def _linear_hook(self, target: str):
        def hook(module, args, output):
            x = args[0]
            for name in self._active():
                weights = self.adapters[name].linear.get(target)
                if weights is not None:
                    a, b = weights
                    mask = self._tokens(name, x.shape[0])
                    output[mask] += (x[mask] @ a.T @ b.T).to(output.dtype)
            return output

        return hook

    def _experts_hook(self, target: str):
        def hook(module, args, kwargs, output):
            values = list(args) + [kwargs[k] for k in ("hidden_states", "top_k_index", "top_k_weights") if k in kwargs]
            hidden, index, weights = values[:3]
            for name in self._active():
                lora = self.adapters[name].experts.get(target)
                if lora is not None:
                    mask = self._tokens(name, hidden.shape[0])
                    output[mask] = experts_forward(module, hidden[mask], index[mask], weights[mask], lora)
            return output

        return hook


def experts_forward(
    experts: torch.nn.Module, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, lora: ExpertsLora
) -> torch.Tensor:
    """transformers' eager experts forward over `hidden` [N, H] routed by `index`/`weights` [N, k],
    with `lora`'s low-rank terms on gate_up_proj and down_proj."""
    out = torch.zeros_like(hidden)
    for expert in index.unique().tolist():
        if expert >= experts.gate_up_proj.shape[0]:  # transformers' marker of a non-local expert
            continue
        token, slot = (index == expert).nonzero(as_tuple=True)
        x = hidden[token]
        gate_up = F.linear(x, experts.gate_up_proj[expert])
        if lora.gate_up is not None:
            a, b = lora.gate_up
            gate_up = gate_up + (x @ a[expert].T) @ b[expert].T
        gate, up = gate_up.chunk(2, dim=-1)
        h = experts.act_fn(gate) * up
        y = F.linear(h, experts.down_proj[expert])
        if lora.down is not None:
            a, b = lora.down
            y = y + (h @ a[expert].T) @ b[expert].T
        out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
    return out
