"""SGLang launcher: the command line (everywhere) and a real server (GPU + sglang only)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from moe_rl.engine.client import EngineClient
from moe_rl.engine.sampling import SamplingParams
from moe_rl.engine.sglang_launcher import SGLangConfig, launch_sglang, sglang_command
from tests.engine.engine_helpers import run

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)


def test_command_line_has_what_rl_needs():
    command = sglang_command(
        SGLangConfig(
            model_path="/m", tp_size=4, ep_size=4, weight_version="7", enable_memory_saver=True, mem_fraction_static=0.6
        ),
        port=30001,
    )
    joined = " ".join(command)
    for flag in (
        "-m sglang.launch_server",
        "--model-path /m",
        "--port 30001",
        "--tp-size 4",
        "--ep-size 4",
        "--weight-version 7",
        "--mem-fraction-static 0.6",
        "--enable-return-routed-experts",
        "--enable-memory-saver",
        "--skip-tokenizer-init",
    ):
        assert flag in joined
    with pytest.raises(ValueError, match="ep_size"):
        SGLangConfig(model_path="/m", tp_size=2, ep_size=4)


def _gpu_and_sglang() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and importlib.util.find_spec("sglang") is not None


@pytest.mark.gpu_sglang
@pytest.mark.skipif(not _gpu_and_sglang(), reason="needs a CUDA GPU and sglang installed")
def test_sglang_generates_with_routed_experts_and_versions(tmp_path):
    from tests.engine.engine_helpers import save_tiny_model

    model_dir = save_tiny_model("qwen3_moe", tmp_path / "m")
    with launch_sglang(SGLangConfig(model_path=str(model_dir), weight_version="0", mem_fraction_static=0.3)) as engine:

        async def go():
            client = EngineClient(engine.url, kind="sglang", num_hidden_layers=3, topk=2)
            result = await client.generate(
                [1, 2, 3, 4], SamplingParams(max_new_tokens=8, ignore_eos=True), return_routed_experts=True
            )
            await client.pause_generation("retract")
            await client.continue_generation()
            await client.close()
            return result

        result = run(go())
    assert len(result.output_ids) == 8 == len(result.logprobs) and result.weight_version == 0
    assert result.routed_experts.shape == (4 + 8 - 1, 3, 2) and np.all(result.routed_experts < 4)


@pytest.mark.gpu_sglang
@pytest.mark.skipif(not _gpu_and_sglang(), reason="needs a CUDA GPU and sglang installed")
def test_nccl_weight_sync_into_a_real_sglang_engine(tmp_path):
    """The broadcast transport over NCCL into SGLang: session, buckets without a version, commit."""
    import torch

    from moe_rl.engine.embedded.runner import load_checkpoint_state
    from sync.config import SyncConfig
    from sync.sender import WeightSender
    from tests.engine.engine_helpers import save_tiny_model

    model_dir = save_tiny_model("qwen3_moe", tmp_path / "m")
    new_state = load_checkpoint_state(save_tiny_model("qwen3_moe", tmp_path / "new", seed=1))
    with launch_sglang(SGLangConfig(model_path=str(model_dir), weight_version="0", mem_fraction_static=0.3)) as engine:
        client = EngineClient(engine.url, kind="sglang", num_hidden_layers=3, topk=2)
        sender = WeightSender(
            [client], SyncConfig(transport="broadcast", backend="nccl", bucket_bytes=1 << 20, timeout_s=120)
        )
        try:
            stats = sender.update(sorted(new_state.items()), 1)
        finally:
            sender.close()

        async def check():
            weights = await client._request(
                "POST", "/get_weights_by_name", {"name": "model.embed_tokens.weight", "truncate_size": 8}
            )
            result = await client.generate([1, 2, 3], SamplingParams(max_new_tokens=2, ignore_eos=True))
            await client.close()
            return weights, result

        weights, result = run(check())
    assert stats.engines == [client.name] and result.weight_version == 1
    expected = new_state["model.embed_tokens.weight"][:8].float()
    assert torch.allclose(torch.tensor(weights).float(), expected, atol=1e-2)
