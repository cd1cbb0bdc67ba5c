"""The Megatron trainer on CUDA with no CPU compatibility patch: a few steps on a tiny MoE (loss
finite and falling), a dist checkpoint saved and loaded back bit-exact, trainer tokens/s; in fp32
and in bf16 (trainer.precision).
With two GPUs: the same under TP2 x EP2 over NCCL. About 1 GB of GPU memory, under a minute."""

from __future__ import annotations

import math
import time

import pytest
import torch

from parallel.world import spawn
from tests.gpu.metrics import record

pytestmark = pytest.mark.gpu


def train_save_load(directory: str, layout: dict) -> dict:
    """Rank function: 6 steps, 3 timed, save, load into a fresh trainer, compare parameters."""
    from moe_rl.config import OptimizerConfig, TrainerConfig
    from moe_rl.trainer.checkpoint import load_checkpoint, save_checkpoint
    from moe_rl.trainer.megatron_trainer import MegatronTrainer
    from parallel import cpu_compat
    from tests.tiny_models import hf_config

    config = TrainerConfig(**layout, micro_batch_size=1, global_batch_size=4, optimizer=OptimizerConfig(lr=3e-3))
    trainer = MegatronTrainer(config, hf_config())
    params = dict(trainer.gpt_model.named_parameters())
    assert not cpu_compat.needed() and all(p.is_cuda for p in params.values())
    tokens = torch.randint(0, 256, (4, 65), generator=torch.Generator().manual_seed(1))
    batch = {"tokens": tokens, "loss_mask": torch.ones_like(tokens)}
    losses = [trainer.train_step(batch).loss for _ in range(3)]
    torch.cuda.synchronize()
    start = time.perf_counter()
    losses += [trainer.train_step(batch).loss for _ in range(3)]
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    save_checkpoint(trainer, directory)
    fresh = MegatronTrainer(config, hf_config())
    load_checkpoint(fresh, directory)
    loaded = dict(fresh.gpt_model.named_parameters())
    return {
        "losses": losses,
        "tokens_per_s": 3 * tokens.numel() / seconds,
        "same": all(torch.equal(p, loaded[n]) for n, p in params.items()),
        "peak_gb": torch.cuda.max_memory_allocated() / 2**30,
    }


@pytest.mark.parametrize(
    "layout",
    [
        dict(world_size=1),
        dict(world_size=1, precision="bf16"),
        dict(world_size=2, tp=2, etp=1, ep=2, sequence_parallel=True),
    ],
    ids=["one-gpu", "one-gpu-bf16", "tp2-ep2"],
)
def test_trainer_steps_and_dist_checkpoint_on_cuda(tmp_path, layout):
    if torch.cuda.device_count() < layout["world_size"]:
        pytest.skip(f"needs {layout['world_size']} GPUs")
    result = spawn(train_save_load, layout["world_size"], str(tmp_path / "ckpt"), layout)[0]
    losses = result["losses"]
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0], losses
    assert result["same"], "the loaded parameters differ from the saved ones"
    print(f"peak GPU memory {result['peak_gb']:.2f} GB a rank; losses {losses}")
    if layout == dict(world_size=1):
        record("trainer_tokens_per_s", result["tokens_per_s"], "tokens/s (tiny MoE, one GPU)")
