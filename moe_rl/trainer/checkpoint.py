"""Megatron dist checkpoints of a trainer: model, optimizer, RNG, step.

Format: megatron-core `dist_checkpointing` (torch_dist), which stores every tensor by its
global shape and offset, so a checkpoint saved under one layout (TP2+EP2) loads under
another (PP2). Optimizer state uses the layout-independent `fully_reshardable` format
(also for the distributed optimizer). RNG states are per rank and only restored when the
layout is the same (a different layout has different ranks); otherwise they restart from
the seed, and a warning says so.

With LoRA only the adapters (and their optimizer state) are saved: the frozen base is rebuilt
from `model.path` or the seed.

Precision: with trainer.precision bf16 the model state is the bf16 parameters and the optimizer
state holds the fp32 main parameters, so a resume continues from the fp32 values. A checkpoint
records its precision; resuming it with the optimizer needs the same trainer.precision (the two
optimizers' states differ). Loading without the optimizer works across precisions: the fp32 main
parameters are then rebuilt from the loaded model parameters.

Writes go to `<dir>.tmp` and are renamed when every rank has finished, so a crash never
leaves a half-written checkpoint under the final name.
"""

from __future__ import annotations

import json
import random
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from moe_rl.conversion.directory import write_lora_meta
from parallel.dist_checkpoint import save_sharded
from parallel.lora import adapter_parameters, adapter_sharded_state_dict
from parallel.staging import fresh_staging, publish, staging_dir

LAYOUT_FILE = "moe_rl_layout.json"
"""The saving trainer's layout (`_layout_record`) plus its trainer.precision."""
_OPTIMIZER_METADATA = {
    "distrib_optim_sharding_type": "fully_reshardable",
    "chained_optim_avoid_prefix": True,  # same keys whether expert params get their own optimizer
}


def _layout_record(trainer) -> dict:
    c = trainer.config
    return dict(
        world_size=c.world_size,
        tp=c.tp,
        pp=c.pp,
        cp=c.cp,
        ep=c.ep,
        etp=c.expert_tp,
        sequence_parallel=c.sequence_parallel,
    )


def _rng_object(rank: int, world_size: int, state=None):
    # heavy: megatron-core, loaded only where a model is built (after parallel.cpu_compat.apply)
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    if state is None:
        state = dict(
            random=random.getstate(),
            numpy=np.random.get_state(),
            torch=torch.get_rng_state(),
            tracker=get_cuda_rng_tracker().get_states(),
        )
    return ShardedObject("rng_state", state, (world_size,), (rank,), replica_id=0)


def _sharded_state(trainer, with_rng: bool, is_loading: bool) -> dict:
    model = trainer.gpt_model
    # with LoRA the frozen base comes from model.path / the seed, not from here
    model_state = model.sharded_state_dict() if trainer.lora is None else adapter_sharded_state_dict(model)
    state = {
        "model": model_state,
        "optimizer": trainer.optimizer.sharded_state_dict(
            model_state, is_loading=is_loading, metadata=_OPTIMIZER_METADATA
        ),
        "step": trainer.step,
    }
    if with_rng:
        state["rng_state"] = _rng_object(dist.get_rank(), dist.get_world_size())
    return state


def save_checkpoint(trainer, directory: str | Path) -> Path:
    """Save on every rank (collective); returns the final directory."""
    final, staging = Path(directory), staging_dir(directory)
    _stage(final)
    save_sharded(_sharded_state(trainer, with_rng=True, is_loading=False), staging)
    _complete(trainer, staging, final)
    return final


class BackgroundCheckpoints:
    """Checkpoints whose tensors are written in the background (megatron-core's async
    `dist_checkpointing`: a forked writer holds the state as it was at `save`, so training goes on
    meanwhile). `save` returns once the state is planned and handed over; `finish` (collective,
    cheap when nothing is due) completes the written ones: metadata, layout record, the rename to
    the final name. A process that dies first leaves only `<dir>.tmp`."""

    def __init__(self):
        # heavy: megatron-core, loaded only where a model is built (after parallel.cpu_compat.apply)
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.queue = AsyncCallsQueue()
        self.pending: dict[int, Path] = {}  # the queue's call index -> final directory

    def save(self, trainer, directory: str | Path) -> None:
        final, staging = Path(directory), staging_dir(directory)
        _stage(final)
        request = save_sharded(_sharded_state(trainer, with_rng=True, is_loading=False), staging, asynchronous=True)
        request.add_finalize_fn(lambda: _complete(trainer, staging, final))
        self.pending[self.queue.schedule_async_request(request)] = final

    def finish(self, blocking: bool = False) -> list[str]:
        """Complete the checkpoints written on every rank (`blocking`: wait for all); their final
        directories."""
        if not self.pending:  # every rank agrees: they saved the same checkpoints
            return []
        return [str(self.pending.pop(index)) for index in self.queue.maybe_finalize_async_calls(blocking=blocking)]


def _stage(final: Path) -> None:
    if dist.get_rank() == 0:
        fresh_staging(final)
    dist.barrier()


def _complete(trainer, staging: Path, final: Path) -> None:
    """The tensors are written: the layout record, then the rename to `final` (collective)."""
    if dist.get_rank() == 0:
        record = {**_layout_record(trainer), "precision": trainer.config.precision}
        (staging / LAYOUT_FILE).write_text(json.dumps(record))
        if trainer.lora is not None:  # `moe-rl convert megatron-to-peft` reads the adapters from here
            hf = trainer.bridge.hf
            write_lora_meta(staging, hf if isinstance(hf, dict) else hf.to_dict(), trainer.lora)
    dist.barrier()
    if dist.get_rank() == 0:
        publish(staging, final)
    dist.barrier()


def load_checkpoint(trainer, directory: str | Path, load_optimizer: bool = True) -> None:
    """Load into an already-built trainer of any layout (collective)."""
    # heavy: megatron-core, loaded only where a model is built (after parallel.cpu_compat.apply)
    from megatron.core import dist_checkpointing
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    directory = Path(directory)
    if not (directory / LAYOUT_FILE).is_file():
        raise ValueError(f"{str(directory)!r} is not a moe-rl trainer checkpoint ({LAYOUT_FILE} missing)")
    saved_layout = json.loads((directory / LAYOUT_FILE).read_text())
    saved_precision = saved_layout.pop("precision", "fp32")  # checkpoints before trainer.precision: fp32
    if load_optimizer and saved_precision != trainer.config.precision:
        raise ValueError(
            f"{str(directory)!r} was trained with trainer.precision={saved_precision!r}, its optimizer state "
            f"does not fit trainer.precision={trainer.config.precision!r}: resume with "
            f"trainer.precision: {saved_precision}, or load the model alone (load_optimizer=False)"
        )
    saved_layout.setdefault("cp", 1)  # checkpoints before trainer.cp: no context parallelism
    same_layout = saved_layout == _layout_record(trainer)
    request = _sharded_state(trainer, with_rng=same_layout, is_loading=True)
    if not load_optimizer:
        request.pop("optimizer")
    state = dist_checkpointing.load(request, str(directory))
    model = trainer.gpt_model
    if trainer.lora is None:
        model.load_state_dict(state["model"])
    else:
        result = model.load_state_dict(state["model"], strict=False)
        missing = set(result.missing_keys) & set(adapter_parameters(model))
        if missing or result.unexpected_keys:
            raise ValueError(
                f"{str(directory)!r}: its adapters do not match lora: (missing {sorted(missing)[:3]}, "
                f"unexpected {result.unexpected_keys[:3]}); resume with the same lora.target_modules"
            )
    if load_optimizer:
        trainer.optimizer.load_state_dict(state["optimizer"])
    else:  # bf16: the fp32 main params start from the loaded model params
        trainer.optimizer.reload_model_params()
    trainer.step = int(state["step"])
    if same_layout:
        rng = state["rng_state"]
        random.setstate(rng["random"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        get_cuda_rng_tracker().set_states(rng["tracker"])
    elif dist.get_rank() == 0:
        warnings.warn(
            f"checkpoint layout {saved_layout} differs from {_layout_record(trainer)}: "
            f"model and optimizer resharded, RNG states restart from the seed"
        )
