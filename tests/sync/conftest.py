"""Fixtures for sync tests: a tiny random Qwen3-MoE in HF on-disk naming, receiver-only engines."""

from __future__ import annotations

import pytest
import torch

from sync.receiver_engine import ReceiverEngineClient, start_receiver_engine
from tests.tiny_models import QWEN3_MOE, hf_config, save_random_model


def tiny_qwen3_moe_config():
    """The shared tiny Qwen3-MoE (tests/tiny_models.py) with 2 layers."""
    return hf_config(QWEN3_MOE, num_hidden_layers=2)


def hf_state_dict(tmp_path, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """Random tiny Qwen3-MoE, saved with save_pretrained and read back: HF checkpoint names."""
    from safetensors.torch import load_file

    save_random_model(tiny_qwen3_moe_config(), tmp_path / "hf", seed=0, dtype=dtype)
    state = {}
    for file in sorted((tmp_path / "hf").glob("*.safetensors")):
        state.update(load_file(file))
    return state


@pytest.fixture(scope="module")
def qwen3_moe_state(tmp_path_factory) -> dict[str, torch.Tensor]:
    return hf_state_dict(tmp_path_factory.mktemp("qwen3moe"))


@pytest.fixture
def engines(request):
    """Two receiver-only engines (separate processes); `request.param` may list each one's `fail_at`."""
    dies = getattr(request, "param", [None, None])
    procs, ports = zip(*[start_receiver_engine(die, timeout_s=20) for die in dies])
    yield [ReceiverEngineClient(port, name=f"engine-{i}") for i, port in enumerate(ports)], procs
    for proc in procs:
        proc.kill()
        proc.join(5)
