"""Tiny random MoE checkpoints and the transformers reference the engine is checked against."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from tests.tiny_models import MIXTRAL, QWEN3_MOE, hf_config, save_random_model


def tiny_config(arch: str):
    """The engine tests' tiny models: the shared Qwen3-MoE and Mixtral (tests/tiny_models.py), 3 layers."""
    if arch == "qwen3_moe":
        return hf_config(QWEN3_MOE, num_hidden_layers=3, max_position_embeddings=512)
    if arch == "mixtral":
        return hf_config(MIXTRAL, num_hidden_layers=3, head_dim=16, max_position_embeddings=512, sliding_window=None)
    raise ValueError(arch)


def save_tiny_model(arch: str, path: Path, seed: int = 0) -> Path:
    """A random tiny model saved with save_pretrained (float32) into `path`."""
    return save_random_model(tiny_config(arch), path, seed)


def load_reference(path: Path):
    import transformers
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    return getattr(transformers, config.architectures[0]).from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def reference(model, prompt: list[int], output: list[int]) -> tuple[list[float], torch.Tensor]:
    """Log-softmax of each output token on the full sequence, and the top-k routing of the
    router logits for every token but the last, [len - 1, layers, topk] (all layers MoE here)."""
    ids = torch.tensor([prompt + output])
    out = model(input_ids=ids, output_router_logits=True)
    logprobs = torch.log_softmax(out.logits[0].float(), dim=-1)
    token_logprobs = [float(logprobs[len(prompt) - 1 + i, t]) for i, t in enumerate(output)]
    k = model.config.num_experts_per_tok
    routing = torch.stack([torch.topk(r, k, dim=-1).indices for r in out.router_logits], dim=1)
    return token_logprobs, routing[: ids.shape[1] - 1].to(torch.int32)


def run(coro):
    return asyncio.run(coro)


async def with_client(url, fn, *args):
    """Run `fn(client, *args)` with a fresh EngineClient for `url`, closed afterwards."""
    from moe_rl.engine.client import EngineClient

    client = EngineClient(url)
    try:
        return await fn(client, *args)
    finally:
        await client.close()


async def engine_load(url: str) -> dict:
    """The engine's GET /get_load record (SGLang's LoadSnapshot, dp rank 0): num_running_reqs (in
    the decode batch), num_waiting_reqs (queued), num_used_tokens (prompt + output tokens the
    running requests hold: it grows by num_running_reqs with every decode step)."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/get_load", timeout=aiohttp.ClientTimeout(total=30)) as response:
            response.raise_for_status()
            (load,) = await response.json()
            return load


async def wait_for_load(url: str, condition, what: str, timeout_s: float = 60.0, poll_s: float = 0.01) -> dict:
    """Poll /get_load until `condition(load)` holds; return that load. Fails the test with `what`
    and the last load after `timeout_s` (generous: a loaded 2-core machine is slow, never this slow)."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        load = await engine_load(url)
        if condition(load):
            return load
        assert time.monotonic() < deadline, f"the engine never {what} within {timeout_s} s; last /get_load: {load}"
        await asyncio.sleep(poll_s)


async def wait_until_decoding(url: str, requests: int, steps: int = 2, timeout_s: float = 60.0) -> dict:
    """Until at least `requests` requests are in the engine's decode batch and it has decoded
    `steps` more tokens for each of them (num_used_tokens grew by requests * steps) since they all
    were: the batch is decoding, observed rather than assumed after a sleep."""
    first = await wait_for_load(
        url, lambda load: load["num_running_reqs"] >= requests, f"ran {requests} requests at once", timeout_s
    )
    target = first["num_used_tokens"] + requests * steps
    return await wait_for_load(
        url,
        lambda load: load["num_running_reqs"] >= requests and load["num_used_tokens"] >= target,
        f"decoded {steps} tokens for each of {requests} running requests (from {first})",
        timeout_s,
    )
