"""Fixtures for sync tests: a tiny random Qwen3-MoE in HF on-disk naming, fake engines."""

from __future__ import annotations

import pytest
import torch

from tests.sync.fake_engine import FakeEngineClient, start_engine


def tiny_qwen3_moe_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        architectures=["Qwen3MoeForCausalLM"],
    )


def hf_state_dict(tmp_path, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """Random tiny Qwen3-MoE, saved with save_pretrained and read back: HF checkpoint names."""
    from safetensors.torch import load_file
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(tiny_qwen3_moe_config()).to(dtype)
    model.save_pretrained(tmp_path / "hf")
    state = {}
    for file in sorted((tmp_path / "hf").glob("*.safetensors")):
        state.update(load_file(file))
    return state


@pytest.fixture(scope="module")
def qwen3_moe_state(tmp_path_factory) -> dict[str, torch.Tensor]:
    return hf_state_dict(tmp_path_factory.mktemp("qwen3moe"))


@pytest.fixture
def engines(request):
    """Two fake engines (separate processes); `request.param` may list each one's `die_at`."""
    dies = getattr(request, "param", [None, None])
    procs, ports = zip(*[start_engine(die, timeout_s=20) for die in dies])
    yield [FakeEngineClient(port, name=f"engine-{i}") for i, port in enumerate(ports)], procs
    for proc in procs:
        proc.kill()
        proc.join(5)
