"""A random init through a bridge is the HF model's: every tensor exported from a freshly built
Megatron model has the spread transformers gives it (`_init_weights`: each linear and embedding
from N(0, initializer_range), norms at one). megatron-core's own default draws the output
projections (attention out, MLP and expert down) at initializer_range / sqrt(2 x layers): a third
of that at 4 layers, which made the agent demo's tiny model learn to read a tool's result hundreds
of steps later (docs/trainer.md#random-initialisation)."""

from __future__ import annotations

import math

import pytest
import torch

from parallel.layout import ParallelLayout
from parallel.world import spawn
from tests.tiny_models import QWEN3_MOE, hf_config, save_random_model

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)


def _megatron_init(config: dict) -> dict[str, torch.Tensor]:
    """Rank function: the HF-named tensors of a Megatron model built at random (one rank)."""
    from megatron.core import parallel_state

    from parallel.bridges import bridge_for
    from parallel.export import export_hf_weights
    from parallel.model import build_gpt_model, init_model_parallel

    layout = ParallelLayout(world_size=1)
    bridge = bridge_for(config)
    init_model_parallel(layout, seed=0)
    model = build_gpt_model(bridge, layout)
    tensors = {name: tensor.clone() for name, tensor in export_hf_weights(model, bridge, bucket_bytes=1 << 20)}
    parallel_state.destroy_model_parallel()
    return tensors


@pytest.mark.parametrize("initializer_range", [0.02, 0.05])
def test_random_init_has_the_hf_models_spread(tmp_path, initializer_range):
    from safetensors.torch import load_file

    config = hf_config(QWEN3_MOE, initializer_range=initializer_range)
    hf_dir = save_random_model(config, tmp_path / "hf")
    reference = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        reference.update(load_file(str(file)))
    (megatron,) = spawn(_megatron_init, 1, config.to_dict())
    assert set(megatron) == set(reference)
    for name, tensor in reference.items():
        hf, ours = tensor.float(), megatron[name].float()
        if hf.std() == 0:  # norms: ones in both
            assert torch.equal(ours, hf), name
            continue
        # both stds are estimates from n draws: each is off by ~1/sqrt(2n) relative; allow 5 sigma
        # of their ratio (0.31 for the router's 256 weights, 0.02 for the embedding's 16k; the
        # scaled init would be off by 1 - 1/sqrt(8) = 0.65)
        tolerance = 5 / math.sqrt(hf.numel())
        ratio = float(ours.std() / hf.std())
        assert abs(ratio - 1) < tolerance, f"{name}: std {float(ours.std()):.4f}, transformers' {float(hf.std()):.4f}"
        assert abs(float(hf.std()) / initializer_range - 1) < tolerance, name
