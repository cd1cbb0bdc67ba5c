"""The frozen reference policy of the KL term: the initial policy, rebuilt on the trainer's ranks.

`build_reference(bridge, config, hf_dir)` builds this rank's stage of a second GPTModel with the
trainer's layout (same TP/PP/EP/ETP shards on the same ranks), in eval mode, every parameter
`requires_grad=False`, no DDP wrapper, no optimizer, no grad buffers. Its weights are
- `hf_dir` given (`algorithm.ref_model_path`, or the run's `model.path`): loaded through the
  bridge importer, exactly as the policy was loaded;
- `hf_dir` None (a random-init policy): Megatron's initialisation replayed from `trainer.seed`,
  i.e. the RNG is re-seeded as `init_model_parallel` seeded it right before the policy was built,
  so the reference equals the policy as initialised, bit for bit, even when it is built after a
  resume (the trainer's RNG state is saved and restored around it).
Either way the reference is the policy of step 0, and a resumed run gets the same reference.
With LoRA the base never changes, so there is no second model: the reference is the policy run
with its adapters off (`parallel.lora.adapters_disabled`, `FrozenModel.adapters_off`), which costs
no memory; `algorithm.ref_model_path` is refused with `lora:` (moe_rl.config).

Routing: with `trainer.routing_replay` the reference's routers are built for replay and get their
own `RoutingReplay`, which drives only the reference's RouterReplay objects. megatron-core keeps
every RouterReplay in one process-global list, but `RoutingReplay` never goes through it, so a
reference forward (replaying the rollout's routing like the policy does) leaves the policy's
replay actions and FIFOs untouched.

Memory (without LoRA): one more copy of the parameters per rank (the policy's share of the model, in
trainer.precision), no gradients or optimizer state: in fp32 that is about 1/4 more than the
policy's parameters + grads + Adam states (4 + 4 + 8 bytes per parameter, + 4 for the reference);
in bf16 about 1/9 (2 + 4 + 12 with fp32 main params, + 2). Collective: every rank of the trainer
world calls `build_reference`.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from moe_rl.conversion.directory import load_model_weights
from moe_rl.trainer.routing_replay import RoutingReplay
from parallel.model import build_gpt_model, precision_config, with_precision


@dataclass
class FrozenModel:
    """A model stage the trainer runs forward-only schedules on, with its own routing replay."""

    model: torch.nn.Module
    routing: RoutingReplay | None
    adapters_off: bool = False
    """True for a LoRA run's reference: `model` is the policy itself, run with its adapters off."""


@contextmanager
def _seeded_as_at_init(seed: int):
    """Re-seed every RNG Megatron's init draws from as `init_model_parallel(layout, seed)` does;
    restore the current states afterwards (the default generator, CUDA's, the tracker's forks)."""
    # heavy: megatron-core, loaded only where a model is built (after parallel.cpu_compat.apply)
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    tracker = get_cuda_rng_tracker()
    cpu, tracked = torch.get_rng_state(), tracker.get_states()
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)
        tracker.set_states(tracked)


def build_reference(bridge, config, hf_dir: str | None) -> FrozenModel:
    """This rank's stage of the frozen reference (see the module docstring). `config` is the
    trainer's `TrainerConfig` (its layout and seed). Collective."""
    overrides = precision_config(config.precision)
    if config.routing_replay:
        overrides["moe_enable_routing_replay"] = True
    if config.max_tokens_per_microbatch is not None:  # micro-batches of different lengths (pipeline p2p)
        overrides["variable_seq_lengths"] = True
    if hf_dir is None:
        with _seeded_as_at_init(config.seed):
            model = build_gpt_model(bridge, config, calculate_per_token_loss=True, **overrides)
    else:
        model = build_gpt_model(bridge, config, calculate_per_token_loss=True, **overrides)
        load_model_weights(model, bridge, hf_dir)  # an HF directory or a converted checkpoint
    model.requires_grad_(False)
    routing = RoutingReplay(model) if config.routing_replay else None
    return FrozenModel(with_precision(model).eval(), routing)
