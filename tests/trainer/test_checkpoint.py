"""Dist checkpoints (model + optimizer + RNG) load under another layout and continue exactly."""

import pytest
import torch
from tiny_qwen3 import hf_config

from parallel.world import spawn

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

TP2_EP2 = dict(world_size=4, tp=2, ep=2, sequence_parallel=True)
PP2 = dict(world_size=2, pp=2)


def _batch():
    tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(1))
    return {"tokens": tokens, "loss_mask": torch.ones_like(tokens)}


def _trainer(layout: dict, distributed: bool):
    from moe_rl.config import OptimizerConfig, TrainerConfig
    from moe_rl.trainer.megatron_trainer import MegatronTrainer

    config = TrainerConfig(
        **layout, micro_batch_size=1, global_batch_size=4, optimizer=OptimizerConfig(lr=3e-3, distributed=distributed)
    )
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


@pytest.mark.parametrize(
    "saved, loaded, distributed",
    [
        (TP2_EP2, PP2, False),
        (PP2, TP2_EP2, True),
    ],
)
def test_checkpoint_loads_under_another_layout(tmp_path, saved, loaded, distributed):
    directory = tmp_path / "ckpt"
    (reference, step_saved_after), *_ = spawn(save_then_continue, saved["world_size"], saved, directory, distributed)
    assert (directory / "moe_rl_layout.json").is_file() and not (tmp_path / "ckpt.tmp").exists()
    (resumed, step_loaded), *_ = spawn(load_then_continue, loaded["world_size"], loaded, directory, distributed)
    assert step_loaded == 2
    # the first loss checks the weights; the second checks the restored Adam moments
    assert resumed == pytest.approx(reference, abs=1e-5), (reference, resumed)


DP2 = dict(world_size=2)  # data parallel 2: the distributed optimizer shards Adam's state over both ranks


def _adam_steps(trainer) -> list[torch.Tensor]:
    """The `step` state of every parameter (shard) of torch's Adam under each distributed optimizer."""
    optimizers = getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])
    return [state["step"] for opt in optimizers for state in opt.optimizer.state.values()]


def _params(trainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.model.module.named_parameters()}


def step_save_step(directory):
    """The run without a resume: a step, a save, the step after it."""
    from moe_rl.trainer.checkpoint import save_checkpoint

    trainer, batch = _trainer(DP2, distributed=True), _batch()
    trainer.train_step(batch)
    save_checkpoint(trainer, directory)
    trainer.train_step(batch)
    return _params(trainer), [float(s) for s in _adam_steps(trainer)]


def load_step(directory):
    """A fresh trainer resumed from that save, then the same step."""
    from moe_rl.trainer.checkpoint import load_checkpoint

    trainer, batch = _trainer(DP2, distributed=True), _batch()
    load_checkpoint(trainer, directory)
    loaded = _adam_steps(trainer)
    trainer.train_step(batch)
    steps = _adam_steps(trainer)
    return (
        _params(trainer),
        [float(s) for s in steps],
        len({id(s) for s in loaded}),
        len({s.data_ptr() for s in steps}),
        len(steps),
    )


def test_distributed_optimizer_resume_gives_each_parameter_its_own_adam_step(tmp_path):
    """cpu_compat patch 8: without Apex/TE, Megatron's load restores Adam's `step` from the
    checkpoint's param_groups as one tensor shared by every parameter; torch's Adam increments it
    in place once per parameter, so the first update after a resume used a wrong bias correction.
    After the patch each parameter has its own step, and the resumed step is the uninterrupted one."""
    directory = tmp_path / "ckpt"
    straight = spawn(step_save_step, 2, directory)
    resumed = spawn(load_step, 2, directory)
    for rank, ((want, want_steps), resume) in enumerate(zip(straight, resumed)):
        got, steps, loaded_objects, step_storages, count = resume
        assert count > 1, f"rank {rank}: no Adam state to check"
        assert loaded_objects == count and step_storages == count, (
            f"rank {rank}: {count} parameters share {loaded_objects} step tensors after the load, "
            f"{step_storages} storages after the step"
        )
        assert want_steps == [2.0] * len(want_steps) and steps == [2.0] * count, (rank, steps)
        assert got.keys() == want.keys()
        differ = [name for name in want if not torch.equal(got[name], want[name])]
        assert not differ, f"rank {rank}: the resumed step differs from the uninterrupted one in {differ}"


def save_in_background_then_continue(directory):
    """A background save, two steps while its writers run, then its completion: training changed
    the weights meanwhile, the checkpoint must hold them as they were at the save."""
    from moe_rl.trainer.checkpoint import BackgroundCheckpoints

    trainer, batch = _trainer(DP2, distributed=True), _batch()
    trainer.train_step(batch)
    trainer.train_step(batch)
    checkpoints = BackgroundCheckpoints()
    checkpoints.save(trainer, directory)
    assert not directory.exists()  # in place only once completed
    losses = [trainer.train_step(batch).loss for _ in range(2)]
    return losses, checkpoints.finish(blocking=True)


def test_background_checkpoint_holds_the_state_of_its_save(tmp_path):
    directory = tmp_path / "ckpt"
    (reference, done), _ = spawn(save_in_background_then_continue, 2, directory)
    assert done == [str(directory)] and not (tmp_path / "ckpt.tmp").exists()
    (resumed, step_loaded), _ = spawn(load_then_continue, 2, DP2, directory, True)
    assert step_loaded == 2
    assert resumed == reference  # the same arithmetic from the same state: equal, not close
