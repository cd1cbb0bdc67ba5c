"""`moe-rl bench engine`: concurrent vs serial generation on one engine, in the same run.

Starts the embedded engine on MODEL_DIR (or a tiny random Qwen3-MoE when none is given), or uses
a running engine (`--url`, SGLang or embedded). Sends `--requests` requests one after another,
then the same requests all at once, and reports output tokens/s of each and the speedup.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time

COMMAND = ("bench", "engine")
HELP = "measure an engine's continuous batching: N concurrent requests vs the same N serially"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-dir", help="HF MoE model directory (default: a tiny random Qwen3-MoE)")
    parser.add_argument("--url", help="benchmark a running engine instead of starting one")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--json", action="store_true", help="print one JSON line instead of a table")


def tiny_model_dir() -> str:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, architectures=["Qwen3MoeForCausalLM"],
    )
    path = tempfile.mkdtemp(prefix="moe-rl-bench-")
    Qwen3MoeForCausalLM(config).save_pretrained(path)
    return path


async def measure(url: str, requests: int, prompt_len: int, max_new_tokens: int) -> dict:
    from moe_rl.engine.client import EngineClient

    client = EngineClient(url)
    prompts = [[(17 * i + j) % 200 + 1 for j in range(prompt_len)] for i in range(requests)]

    async def one(i: int) -> int:
        result = await client.generate(prompts[i], max_new_tokens=max_new_tokens, seed=i, ignore_eos=True,
                                       return_routed_experts=True)
        return len(result.output_ids)

    try:
        await one(0)  # warm up
        start = time.perf_counter()
        serial_tokens = sum([await one(i) for i in range(requests)])
        serial_s = time.perf_counter() - start
        start = time.perf_counter()
        concurrent_tokens = sum(await asyncio.gather(*(one(i) for i in range(requests))))
        concurrent_s = time.perf_counter() - start
    finally:
        await client.close()
    return {
        "requests": requests, "prompt_len": prompt_len, "max_new_tokens": max_new_tokens,
        "serial_s": round(serial_s, 3), "serial_tok_per_s": round(serial_tokens / serial_s, 1),
        "concurrent_s": round(concurrent_s, 3), "concurrent_tok_per_s": round(concurrent_tokens / concurrent_s, 1),
        "speedup": round(serial_s / concurrent_s, 2),
    }


def run(args: argparse.Namespace) -> int:
    if args.requests < 1 or args.max_new_tokens < 1 or args.prompt_len < 1:
        raise ValueError("--requests, --prompt-len and --max-new-tokens must be >= 1")
    if args.url:
        report = asyncio.run(measure(args.url, args.requests, args.prompt_len, args.max_new_tokens))
    else:
        from moe_rl.engine.process import launch_embedded

        with launch_embedded(args.model_dir or tiny_model_dir(), max_batch=max(64, args.requests)) as engine:
            report = asyncio.run(measure(engine.url, args.requests, args.prompt_len, args.max_new_tokens))
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{report['requests']} requests x {report['max_new_tokens']} new tokens (prompt {report['prompt_len']})")
        print(f"  serial     {report['serial_s']:8.2f} s  {report['serial_tok_per_s']:9.1f} tok/s")
        print(f"  concurrent {report['concurrent_s']:8.2f} s  {report['concurrent_tok_per_s']:9.1f} tok/s")
        print(f"  speedup    {report['speedup']:8.2f}x")
    return 0
