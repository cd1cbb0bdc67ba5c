"""How the MoE routers train: megatron-core's router settings, chosen by one typed object.

megatron-core spreads them over TransformerConfig fields and the built model; `RouterTraining`
sets them in one place (`Bridge.transformer_config(layout, router=...)` for the config,
`RouterTraining.apply` on the built model, both done by `parallel.model.build_gpt_model`):
- The load-balancing loss: `moe_aux_loss_coeff` with the `moe_router_load_balancing_type` the
  architecture was trained with (`Bridge.aux_loss_type`), "none" at coefficient 0.
- The expert bias (DeepSeek-V3 / GLM-4.5's `mlp.gate.e_score_correction_bias`, megatron-core's
  `router.expert_bias`: a buffer, not a parameter, so it never has a gradient). One flag,
  `moe_router_enable_expert_bias`, both creates it and, in `finalize_model_grads`, moves it every
  step by `moe_router_bias_update_rate` x sign(mean count - the expert's count), from the tokens
  each router sent to each expert in the step (the replayed routing under R3), padding left out when
  the forward is given a padding mask (`counts_tokens`). At rate 0, and on a frozen router, the
  update is switched off after the build (`apply`): the bias still routes, nothing moves it, and the
  step's token counts are neither kept nor all-reduced.
- Freezing: router weights get requires_grad False before DDP and the optimizer are built, so they
  have no gradient and no optimizer state; gradients still flow through the routing probabilities
  into the layers below. Exports and weight syncs read them like every other weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch


@dataclass(frozen=True, kw_only=True)
class RouterTraining:
    """What the optimizer step does to the routers (defaults: they train, nothing else moves them)."""

    freeze: bool = False
    """Router weights and expert biases stay as loaded: no gradient, no optimizer state, no update."""
    bias_update_rate: float = 0.0
    """megatron-core's `moe_router_bias_update_rate` (models with an expert bias only); 0 = no update."""
    aux_loss_coeff: float = 0.0
    """megatron-core's `moe_aux_loss_coeff`; 0 = no load-balancing loss."""

    def config_kwargs(self, has_expert_bias: bool, aux_loss_type: str) -> dict[str, Any]:
        """The TransformerConfig fields of these settings for a model that has (or lacks) an expert
        bias and balances its load with `aux_loss_type` (a megatron-core load-balancing type)."""
        if self.bias_update_rate and not has_expert_bias:
            raise ValueError(
                f"expert-bias update rate {self.bias_update_rate} on a model without an expert bias "
                "(e_score_correction_bias): set it to 0"
            )
        kwargs: dict[str, Any] = dict(
            moe_router_load_balancing_type=aux_loss_type if self.aux_loss_coeff else "none",
            moe_aux_loss_coeff=self.aux_loss_coeff,
        )
        if has_expert_bias:
            kwargs["moe_router_bias_update_rate"] = self.bias_update_rate
        return kwargs

    @property
    def counts_tokens(self) -> bool:
        """Whether a training step reads the routers' token counts (the bias update or the
        load-balancing loss), which should then leave padding out (`parallel.model.forward`'s
        `padding_mask`)."""
        return self.updates_bias or self.aux_loss_coeff != 0

    @property
    def updates_bias(self) -> bool:
        """Whether the optimizer step moves the expert biases (never on a frozen router)."""
        return self.bias_update_rate != 0 and not self.freeze

    def apply(self, model) -> None:
        """Freeze the routers of `model` (a GPTModel stage) if asked, and switch the expert-bias
        update off unless `updates_bias`. Call before DDP and the optimizer are built."""
        # heavy: megatron-core, loaded only where a model is built (after parallel.cpu_compat.apply)
        from megatron.core.transformer.moe.router import Router

        routers = [module for module in model.modules() if isinstance(module, Router)]
        if self.freeze:
            for router in routers:
                router.requires_grad_(False)
        if self.updates_bias:
            for router in routers:
                router._apply_expert_bias = partial(_count_routed_tokens, router)
        else:
            # megatron-core ties "has a bias" and "updates it" to one config flag, read by the router
            # at construction (token counting) and by finalize_model_grads every step (the update):
            # the bias buffers exist by now, so both readers are told there is no update
            for router in routers:
                router.enable_expert_bias = False
            model.config.moe_router_enable_expert_bias = False


def _count_routed_tokens(router, routing_map: torch.Tensor, padding_mask: torch.Tensor | None = None) -> None:
    """megatron-core's `Router._apply_expert_bias` (0.16, 0.19), whose `routing_map & ~padding_mask`
    broadcasts the [tokens] mask over the experts of the [tokens, experts] map (an error unless the
    two sizes agree); here the mask covers whole rows. Counts what a training forward routed."""
    if router.enable_expert_bias and torch.is_grad_enabled():  # a training forward (or its recompute)
        with torch.no_grad():
            if padding_mask is not None:
                routing_map = routing_map & ~padding_mask[:, None]
            router.local_tokens_per_expert += routing_map.sum(dim=0)
