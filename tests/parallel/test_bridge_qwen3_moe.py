"""Qwen3-MoE bridge: import -> export is bit-exact and Megatron logits equal transformers'
under every layout (one 4-rank world for seven layouts, one 8-rank world for TP2xPP2xEP2)."""

from __future__ import annotations

import pytest
import torch
from test_bridge_harness import BATCH, SEQ, assert_layout_results, check_layouts, hf_reference, save_tiny_hf_model

from parallel.layout import ParallelLayout
from parallel.world import spawn
from tests.tiny_models import QWEN3_MOE, hf_config

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)


def qwen3_moe_config(**overrides):
    """The shared tiny Qwen3-MoE (tests/tiny_models.py) with a dense first layer."""
    return hf_config(QWEN3_MOE, **{"mlp_only_layers": [0], **overrides})


FOUR_RANK_LAYOUTS = [
    ParallelLayout(world_size=4),
    ParallelLayout(world_size=4, tp=2, sequence_parallel=True),
    ParallelLayout(world_size=4, pp=2),
    ParallelLayout(world_size=4, ep=2),
    ParallelLayout(world_size=4, tp=2, ep=2, sequence_parallel=True),
    ParallelLayout(world_size=4, pp=2, ep=2, etp=1),
    ParallelLayout(world_size=4, ep=2, etp=2),
]
EIGHT_RANK_LAYOUTS = [ParallelLayout(world_size=8, tp=2, pp=2, ep=2, sequence_parallel=True)]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return save_tiny_hf_model(qwen3_moe_config(), tmp_path_factory.mktemp("qwen3_moe"))


@pytest.mark.parametrize(
    "world_size,layouts", [(4, FOUR_RANK_LAYOUTS), (8, EIGHT_RANK_LAYOUTS)], ids=["4ranks", "8ranks"]
)
def test_qwen3_moe_roundtrip_and_logits(hf_dir, world_size, layouts):
    tokens = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    per_rank = spawn(check_layouts, world_size, str(hf_dir), layouts, tokens, 4096)
    losses = assert_layout_results(per_rank, hf_dir, hf_reference(hf_dir, tokens), tokens)
    assert len(losses) == len(layouts)
