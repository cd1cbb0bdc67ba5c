"""The embedded engine against the transformers model: logprobs, routed experts, seeds, LoRA.

Concurrent requests of different prompt lengths are decoded in one batch with left padding and a
KV cache; every reported logprob must equal the model's log-softmax on the full sequence and every
routing row the top-k of a reference forward's router logits.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from moe_rl.engine.client import EngineClient
from moe_rl.engine.process import EmbeddedConfig, launch_embedded
from moe_rl.engine.sampling import SamplingParams
from tests.engine.engine_helpers import load_reference, reference, run, with_client

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

PROMPTS = [[(7 * i + 3 * j) % 256 for j in range(3 + 2 * i)] for i in range(8)]


async def generate_all(client: EngineClient, prompts, **kwargs):
    return await asyncio.gather(
        *(
            client.generate(
                p,
                SamplingParams(max_new_tokens=12, sampling_seed=100 + i, ignore_eos=True),
                return_routed_experts=True,
                **kwargs,
            )
            for i, p in enumerate(prompts)
        )
    )


def check_against_reference(model, prompts, results):
    for prompt, result in zip(prompts, results):
        assert result.finish_reason == "length" and len(result.output_ids) == 12
        logprobs, routing = reference(model, prompt, result.output_ids)
        assert np.allclose(result.logprobs, logprobs, atol=1e-4, rtol=0), (result.logprobs, logprobs)
        assert result.routed_experts.dtype == np.int32
        assert result.routed_experts.shape == (len(prompt) + 12 - 1, model.config.num_hidden_layers, 2)
        assert np.array_equal(result.routed_experts, routing.numpy())


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_logprobs_and_routing_match_transformers(arch, qwen3_engine, qwen3_dir, mixtral_dir):
    if arch == "qwen3_moe":
        model_dir, results = qwen3_dir, run(with_client(qwen3_engine.url, generate_all, PROMPTS))
    else:
        model_dir = mixtral_dir
        with launch_embedded(EmbeddedConfig(model_path=mixtral_dir, threads=1)) as engine:
            results = run(with_client(engine.url, generate_all, PROMPTS))
    check_against_reference(load_reference(model_dir), PROMPTS, results)


def test_seeded_sampling_is_reproducible_and_versions_are_reported(qwen3_engine):
    async def go(client):
        first = await generate_all(client, PROMPTS[:4])
        second = await generate_all(client, PROMPTS[:4])
        info = await client.model_info()
        return first, second, info

    first, second, info = run(with_client(qwen3_engine.url, go))
    assert [r.output_ids for r in first] == [r.output_ids for r in second]
    assert all(str(r.weight_version) == info["weight_version"] == "0" for r in first)
    assert all(r.weight_versions == [0] * 12 for r in first)


def test_greedy_and_stop_tokens(qwen3_engine, qwen3_dir):
    model = load_reference(qwen3_dir)

    async def go(client):
        greedy = await client.generate(PROMPTS[2], SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True))
        stop = await client.generate(
            PROMPTS[2], SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=[greedy.output_ids[2]])
        )
        return greedy, stop

    greedy, stop = run(with_client(qwen3_engine.url, go))
    with torch.no_grad():
        ids = torch.tensor([PROMPTS[2] + greedy.output_ids])
        argmax = model(input_ids=ids).logits[0, len(PROMPTS[2]) - 1 : -1].argmax(-1).tolist()
    assert greedy.output_ids == argmax
    assert stop.finish_reason == "stop" and stop.output_ids == greedy.output_ids[:3]


def test_lora_adapter_matches_merged_weights(qwen3_engine, qwen3_dir, tmp_path):
    """A PEFT adapter on q_proj/o_proj, used by half the batch; the rest stays on the base model."""
    model = load_reference(qwen3_dir)
    torch.manual_seed(1)
    rank, alpha, tensors = 4, 8, {}
    for layer in range(model.config.num_hidden_layers):
        for proj in ("q_proj", "o_proj"):
            linear = getattr(model.model.layers[layer].self_attn, proj)
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, linear.in_features) * 0.3
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(linear.out_features, rank) * 0.3
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": ["q_proj", "o_proj"]})
    )

    async def go(client):
        await client.load_lora_adapter("policy", str(tmp_path))
        return await asyncio.gather(
            *(
                client.generate(
                    p,
                    SamplingParams(max_new_tokens=12, sampling_seed=i, ignore_eos=True),
                    return_routed_experts=True,
                    lora_path="policy" if i % 2 else None,
                )
                for i, p in enumerate(PROMPTS[:4])
            )
        )

    results = run(with_client(qwen3_engine.url, go))
    base = [results[0], results[2]]
    check_against_reference(model, [PROMPTS[0], PROMPTS[2]], base)
    with torch.no_grad():
        for key, a in tensors.items():
            if key.endswith("lora_A.weight"):
                module = model.get_submodule(key[len("base_model.model.") : -len(".lora_A.weight")])
                module.weight += (alpha / rank) * tensors[key.replace("lora_A", "lora_B")] @ a
    check_against_reference(model, [PROMPTS[1], PROMPTS[3]], [results[1], results[3]])
