"""Dist checkpoints (model + optimizer + RNG) load under another layout and continue exactly."""

import pytest
import torch

from parallel.world import spawn
from tiny_qwen3 import hf_config

TP2_EP2 = dict(world_size=4, tp=2, ep=2, sequence_parallel=True)
PP2 = dict(world_size=2, pp=2)


def _batch():
    tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(1))
    return {"tokens": tokens, "loss_mask": torch.ones_like(tokens)}


def _trainer(layout: dict, distributed: bool):
    from moe_rl.config import OptimizerConfig, TrainerConfig
    from moe_rl.trainer.megatron_trainer import MegatronTrainer

    config = TrainerConfig(**layout, micro_batch_size=1, global_batch_size=4,
                           optimizer=OptimizerConfig(lr=3e-3, distributed=distributed))
    return MegatronTrainer(config, hf_config())


def save_then_continue(layout, directory, distributed):
    """Two steps, save, two more steps: the losses after the save are the reference."""
    from moe_rl.trainer.checkpoint import save_checkpoint

    trainer, batch = _trainer(layout, distributed), _batch()
    trainer.train_step(batch)
    trainer.train_step(batch)
    save_checkpoint(trainer, directory)
    return [trainer.train_step(batch).loss for _ in range(2)], trainer.step


def load_then_continue(layout, directory, distributed):
    from moe_rl.trainer.checkpoint import load_checkpoint

    trainer, batch = _trainer(layout, distributed), _batch()
    load_checkpoint(trainer, directory)
    step = trainer.step
    return [trainer.train_step(batch).loss for _ in range(2)], step


@pytest.mark.parametrize("saved, loaded, distributed", [
    (TP2_EP2, PP2, False),
    (PP2, TP2_EP2, True),
])
def test_checkpoint_loads_under_another_layout(tmp_path, saved, loaded, distributed):
    directory = tmp_path / "ckpt"
    (reference, step_saved_after), *_ = spawn(save_then_continue, saved["world_size"], saved,
                                             directory, distributed)
    assert (directory / "moe_rl_layout.json").is_file() and not (tmp_path / "ckpt.tmp").exists()
    (resumed, step_loaded), *_ = spawn(load_then_continue, loaded["world_size"], loaded, directory,
                                      distributed)
    assert step_loaded == 2
    # the first loss checks the weights; the second checks the restored Adam moments
    assert resumed == pytest.approx(reference, abs=1e-5), (reference, resumed)
