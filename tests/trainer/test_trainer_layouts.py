"""Every parallel layout trains: finite loss, the same grad norm on every rank, falling loss.

Layouts sharing a world size run one after another in one spawned gloo world (world build
dominates the cost on 2 cores).
"""

import math

import pytest
import torch
from tiny_qwen3 import hf_config

from parallel.world import spawn

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

STEPS = 10
LAYOUTS = {
    1: [dict(world_size=1)],
    2: [dict(world_size=2, tp=2, sequence_parallel=True), dict(world_size=2, pp=2), dict(world_size=2, ep=2)],
    4: [
        dict(world_size=4, tp=2, ep=2, sequence_parallel=True),
        dict(world_size=4, pp=2, ep=2),
        dict(world_size=4, ep=2, etp=2),
    ],
    8: [dict(world_size=8, tp=2, pp=2, ep=2, sequence_parallel=True)],
}


def train_layouts(layouts: list[dict]) -> list[list[tuple[float, float]]]:
    from moe_rl.config import OptimizerConfig, TrainerConfig
    from moe_rl.trainer.megatron_trainer import MegatronTrainer

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (4, 25), generator=generator)
    batch = {"tokens": tokens, "loss_mask": torch.ones_like(tokens)}
    curves = []
    for layout in layouts:
        config = TrainerConfig(**layout, micro_batch_size=1, global_batch_size=4, optimizer=OptimizerConfig(lr=3e-3))
        trainer = MegatronTrainer(config, hf_config())
        curves.append([(r.loss, r.grad_norm) for r in (trainer.train_step(batch) for _ in range(STEPS))])
    return curves


@pytest.mark.parametrize("world_size", sorted(LAYOUTS))
def test_layouts_train(world_size):
    per_rank = spawn(train_layouts, world_size, LAYOUTS[world_size])
    for index, layout in enumerate(LAYOUTS[world_size]):
        curve = per_rank[0][index]
        losses = [loss for loss, _ in curve]
        assert all(math.isfinite(loss) for loss in losses), (layout, losses)
        for rank, rank_curves in enumerate(per_rank):
            assert rank_curves[index] == curve, f"rank {rank} disagrees under {layout}"
        assert losses[-1] < losses[0] - 0.5, (layout, losses)
        assert all(math.isfinite(norm) and norm > 0 for _, norm in curve)
