"""LoRA on the embedded engine against PEFT (`PeftModel.from_pretrained` on the same transformers
weights is the oracle): every target (attention, dense MLP, shared experts, per-expert routed
experts on transformers 5's fused parameters), both expert formats, mixed batches, and SGLang's
load/unload rules over HTTP (real server processes)."""

from __future__ import annotations

import asyncio
import json
import re
import time

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import DynamicCache

from moe_rl.engine.client import EngineError
from moe_rl.engine.embedded.lora import LoraAdapter
from moe_rl.engine.embedded.runner import ModelRunner
from moe_rl.engine.lora_tensors import LoraTensorsBody, read_adapter_dir
from moe_rl.engine.process import EmbeddedConfig, launch_embedded
from moe_rl.engine.sampling import SamplingParams
from tests.engine.engine_helpers import load_reference, reference, run, wait_for_load, with_client
from tests.tiny_models import DEEPSEEK_V3, hf_config, save_random_model

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

PROMPTS = [[5, 17, 3, 99, 42], [7, 7, 120, 1], [200, 31, 8, 64, 12, 90]]
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def save_adapter(path, tensors: dict, config: dict):
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", **config}))
    return path


def per_expert_adapter(model, path, rank=4, alpha=8, seed=1):
    """Random 2-D per-expert adapter on q/k/v/o and every routed expert's gate/up/down."""
    generator = torch.Generator().manual_seed(seed)
    cfg, tensors = model.config, {}

    def pair(prefix, out_features, in_features):
        tensors[f"base_model.model.{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * 0.3
        tensors[f"base_model.model.{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.3

    for i, layer in enumerate(model.model.layers):
        for proj in ATTENTION:
            linear = getattr(layer.self_attn, proj)
            pair(f"model.layers.{i}.self_attn.{proj}", linear.out_features, linear.in_features)
        hidden, inter = cfg.hidden_size, cfg.moe_intermediate_size
        for e in range(cfg.num_experts):
            for proj, shape in {
                "gate_proj": (inter, hidden),
                "up_proj": (inter, hidden),
                "down_proj": (hidden, inter),
            }.items():
                pair(f"model.layers.{i}.mlp.experts.{e}.{proj}", *shape)
    return save_adapter(
        path,
        tensors,
        {"r": rank, "lora_alpha": alpha, "target_modules": [*ATTENTION, "gate_proj", "up_proj", "down_proj"]},
    )


def peft_adapter(model_dir, path, target_modules, seed=2, rank=4, alpha=16, use_rslora=False):
    """An adapter PEFT itself makes and saves: `target_modules` (names or a regex) plus PEFT's 3-D `target_parameters`
    on the fused experts (random, not zero-initialised B)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=target_modules,
        use_rslora=use_rslora,
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        init_lora_weights=False,
    )
    model = get_peft_model(load_reference(model_dir), config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.mul_(3.0)  # a visible effect on a random tiny model
    model.save_pretrained(path)
    return path


def peft_reference(model_dir, adapter_dir):
    from peft import PeftModel

    return PeftModel.from_pretrained(load_reference(model_dir), str(adapter_dir)).eval()


async def generate_with(client, pairs):
    return await asyncio.gather(
        *(
            client.generate(
                prompt,
                SamplingParams(max_new_tokens=8, sampling_seed=0, ignore_eos=True),
                return_routed_experts=True,
                lora_path=lora,
            )
            for prompt, lora in pairs
        )
    )


def check(model, prompt, result, routing=True):
    logprobs, routed = reference(model, prompt, result.output_ids)
    assert np.allclose(result.logprobs, logprobs, atol=1e-4, rtol=0), (result.logprobs, logprobs)
    if routing:
        assert np.array_equal(result.routed_experts, routed.numpy())


@pytest.fixture(scope="module")
def adapters(qwen3_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    base = load_reference(qwen3_dir)
    return {
        "per_expert": per_expert_adapter(base, root / "per_expert"),
        "fused": peft_adapter(qwen3_dir, root / "fused", list(ATTENTION)),
    }


def test_every_target_and_both_expert_formats_match_peft(qwen3_engine, qwen3_dir, adapters, tmp_path):
    # the 3-D adapter rewritten per expert (gate and up share PEFT's A): the same deltas
    config, tensors = read_adapter_dir(adapters["fused"])
    cfg = load_reference(qwen3_dir).config
    rewritten, num = {}, cfg.num_experts
    for name, a in tensors.items():
        if ".mlp.experts." not in name:
            rewritten[name] = a
            continue
        if "lora_B" in name:
            continue
        b = tensors[name.replace("lora_A", "lora_B")]
        rank, prefix = a.shape[0] // num, name.split(".mlp.experts.")[0] + ".mlp.experts"
        for e in range(num):  # PEFT: A expert-major [E*r, in], B expert-minor [out, r*E]
            a_e, b_e = a.reshape(num, rank, -1)[e], b.reshape(b.shape[0], rank, num)[:, :, e]
            if a.shape[1] == cfg.hidden_size:  # gate_up_proj: [gate; up] rows
                projs = {"gate_proj": b_e[: b_e.shape[0] // 2], "up_proj": b_e[b_e.shape[0] // 2 :]}
            else:
                projs = {"down_proj": b_e}
            for proj, b_p in projs.items():
                rewritten[f"{prefix}.{e}.{proj}.lora_A.weight"] = a_e.clone()
                rewritten[f"{prefix}.{e}.{proj}.lora_B.weight"] = b_p.clone()
    save_adapter(tmp_path / "rewritten", rewritten, {k: config[k] for k in ("r", "lora_alpha")})

    async def go(client):
        for name in ("per_expert", "fused"):
            assert name in await client.load_lora_adapter(name, str(adapters[name]))
        await client.load_lora_adapter("rewritten", str(tmp_path / "rewritten"))
        return await generate_with(
            client, [(PROMPTS[0], "per_expert"), (PROMPTS[1], "fused"), (PROMPTS[1], "rewritten"), (PROMPTS[2], None)]
        )

    per_expert, fused, rewritten_result, base = run(with_client(qwen3_engine.url, go))
    check(peft_reference(qwen3_dir, adapters["per_expert"]), PROMPTS[0], per_expert)
    check(peft_reference(qwen3_dir, adapters["fused"]), PROMPTS[1], fused)
    assert rewritten_result.output_ids == fused.output_ids  # same seed, same deltas in the other format
    assert np.allclose(rewritten_result.logprobs, fused.logprobs, atol=1e-5, rtol=0)
    check(load_reference(qwen3_dir), PROMPTS[2], base)
    plain = reference(load_reference(qwen3_dir), PROMPTS[0], per_expert.output_ids)[0]
    assert not np.allclose(per_expert.logprobs, plain, atol=1e-2)  # the adapter does change the model


def test_mixed_batch_gives_each_row_its_adapter(qwen3_dir, adapters):
    """One forward whose rows use adapter a, adapter b and none (the scheduler batches them so)."""
    runner = ModelRunner(qwen3_dir)
    runner.add_lora(LoraAdapter.from_dir("a", adapters["per_expert"]))
    runner.add_lora(LoraAdapter.from_dir("b", adapters["fused"]))
    ids = torch.tensor([PROMPTS[0][:4], PROMPTS[2][:4], PROMPTS[1][:4]])
    logprobs, routed, _ = runner.forward(ids, torch.ones_like(ids), DynamicCache(), ["a", "b", None])
    models = [
        peft_reference(qwen3_dir, adapters["per_expert"]),
        peft_reference(qwen3_dir, adapters["fused"]),
        load_reference(qwen3_dir),
    ]
    for row, model in enumerate(models):
        with torch.no_grad():
            out = model(input_ids=ids[row : row + 1], output_router_logits=True)
        assert torch.allclose(logprobs[row], torch.log_softmax(out.logits[0, -1], -1), atol=1e-4)
        topk = torch.stack([torch.topk(r, 2, dim=-1).indices for r in out.router_logits], dim=1)
        assert np.array_equal(routed[row], topk.numpy())


def test_dense_mlp_shared_experts_and_mla_match_peft(tmp_path):
    """DeepSeek-V3 (MLA, a dense first layer, shared experts, sigmoid group-limited routing): PEFT's
    adapter on the MLA projections and the fused experts (3-D format, rsLoRA), plus pairs on the dense
    MLP and the shared experts (PEFT 0.21 maps bare gate/up/down_proj names of an MoE model to the
    routed experts, so these are added to its file; the oracle merges them into PEFT's merged model)."""
    save_random_model(hf_config(DEEPSEEK_V3, num_hidden_layers=2), tmp_path / "model", seed=0)
    mla = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    adapter = peft_adapter(tmp_path / "model", tmp_path / "adapter", mla, use_rslora=True)
    model = peft_reference(tmp_path / "model", adapter).merge_and_unload()
    adapter_config, tensors = read_adapter_dir(adapter)
    scale, generator = adapter_config["lora_alpha"] / adapter_config["r"] ** 0.5, torch.Generator().manual_seed(3)
    with torch.no_grad():
        for target in [
            "model.layers.0.mlp.gate_proj",
            "model.layers.0.mlp.down_proj",
            "model.layers.1.mlp.shared_experts.up_proj",
            "model.layers.1.mlp.shared_experts.down_proj",
        ]:
            linear = model.get_submodule(target)
            a = torch.randn(4, linear.in_features, generator=generator) * 0.3
            b = torch.randn(linear.out_features, 4, generator=generator) * 0.3
            tensors[f"base_model.model.{target}.lora_A.weight"], tensors[f"base_model.model.{target}.lora_B.weight"] = (
                a,
                b,
            )
            linear.weight += scale * b @ a
    save_adapter(tmp_path / "extended", tensors, adapter_config)
    with launch_embedded(EmbeddedConfig(model_path=tmp_path / "model", threads=1)) as engine:

        async def go(client):
            await client.load_lora_adapter("ds", str(tmp_path / "extended"))
            return await generate_with(client, [(PROMPTS[0], "ds"), (PROMPTS[2], "ds")])

        results = run(with_client(engine.url, go))
    for prompt, result in zip([PROMPTS[0], PROMPTS[2]], results):
        check(model, prompt, result, routing=False)  # (the helper's top-k is not DeepSeek's routing)
        assert result.routed_experts.shape == (len(prompt) + 7, 2, 2)


def test_from_tensors_equals_from_disk_and_checksums_are_verified(qwen3_engine, adapters):
    config, tensors = read_adapter_dir(adapters["per_expert"])

    async def go(client):
        await client.load_lora_adapter("disk", str(adapters["per_expert"]))
        loaded = await client.load_lora_adapter_from_tensors("mem", config, tensors)
        assert loaded["mem"] == "__tensor__"
        await client.load_lora_adapter_from_tensors("mem_dict", config, tensors.items(), load_format=None)
        bad = {k: (v + 1 if i == 0 else v) for i, (k, v) in enumerate(tensors.items())}
        body = {
            **LoraTensorsBody.build("bad", config, tensors).to_json(),  # checksums of the true tensors
            "serialized_named_tensors": LoraTensorsBody.build("bad", config, bad).serialized_named_tensors,
        }
        with pytest.raises(EngineError, match="HTTP 400.*expected_checksums: 1 value-diff"):
            await client._request("POST", "/load_lora_adapter_from_tensors", body)
        return await generate_with(client, [(PROMPTS[0], "disk"), (PROMPTS[0], "mem"), (PROMPTS[0], "mem_dict")])

    disk, mem, mem_dict = run(with_client(qwen3_engine.url, go))
    assert disk.output_ids == mem.output_ids == mem_dict.output_ids  # (logprobs: up to batch-shape rounding)
    assert np.allclose(disk.logprobs, mem.logprobs, atol=1e-5) and np.allclose(
        disk.logprobs, mem_dict.logprobs, atol=1e-5
    )


def test_unload_waits_for_the_requests_using_the_adapter(qwen3_engine, adapters):
    async def go(client):
        await client.load_lora_adapter("long", str(adapters["per_expert"]))
        running = asyncio.create_task(
            client.generate(PROMPTS[0], SamplingParams(max_new_tokens=150, ignore_eos=True), lora_path="long")
        )
        await wait_for_load(client.url, lambda load: load["num_running_reqs"] == 1, "ran the request using 'long'")
        unloading = asyncio.create_task(client.unload_lora_adapter("long"))
        deadline = time.monotonic() + 60
        while True:  # unregistered at once (once the unload is in): a new request naming it fails
            try:
                await client.generate(PROMPTS[1], SamplingParams(max_new_tokens=1), lora_path="long")
            except EngineError as error:
                assert re.search("HTTP 400.*not loaded", str(error)), error
                break
            assert not unloading.done(), "the unload finished with a request still using the adapter"
            assert time.monotonic() < deadline, "the unload never unregistered the adapter"
        assert not unloading.done() and not running.done()
        result = await running
        done_at = time.monotonic()
        loaded = await unloading
        return result, done_at, loaded, time.monotonic()

    result, finished, loaded, unloaded = run(with_client(qwen3_engine.url, go))
    assert result.finish_reason == "length" and len(result.output_ids) == 150  # never failed by the unload
    assert "long" not in loaded and unloaded >= finished


def test_load_twice_is_refused_and_an_unknown_adapter_fails_only_its_request(qwen3_engine, adapters):
    async def go(client):
        await client.load_lora_adapter("twice", str(adapters["fused"]))
        with pytest.raises(EngineError, match="HTTP 400.*because it is already loaded"):
            await client.load_lora_adapter("twice", str(adapters["per_expert"]))
        with pytest.raises(EngineError, match="HTTP 400.*does not exist"):
            await client.unload_lora_adapter("never-loaded")
        outcomes = await asyncio.gather(
            client.generate(PROMPTS[0], SamplingParams(max_new_tokens=4, sampling_seed=0), lora_path="unknown"),
            client.generate(PROMPTS[0], SamplingParams(max_new_tokens=4, sampling_seed=0), lora_path="twice"),
            client.generate(PROMPTS[0], SamplingParams(max_new_tokens=4, sampling_seed=0)),
            return_exceptions=True,
        )
        again = await client.generate(PROMPTS[0], SamplingParams(max_new_tokens=4, sampling_seed=0), lora_path="twice")
        return outcomes, again

    (unknown, adapted, base), again = run(with_client(qwen3_engine.url, go))
    assert isinstance(unknown, EngineError) and unknown.status == 400 and "unknown" in unknown.message
    assert adapted.finish_reason == base.finish_reason == "length"
    assert again.output_ids == adapted.output_ids  # the first adapter is still the one served under the name
    assert np.allclose(again.logprobs, adapted.logprobs, atol=1e-5)
