"""`moe-rl bench engine` (options: `moe_rl.bench.options.EngineBench`): concurrent vs serial
generation on one engine, and transformers' own batched `generate()` at equal batch as the
baseline, in the same run.

Starts the embedded engine on MODEL_DIR (or a tiny random Qwen3-MoE when none is given), or uses
a running engine (`--url`, SGLang or embedded). Sends `--requests` requests one after another
(once), then the same requests all at once, `--repeats` times, each time followed by one batched
`generate()` of the same model (float32, the embedded engine's dtype; on CUDA when there is one):
the same prompts as one left-padded batch, the same sampling (temperature 1, top_p 1, no top-k)
and exactly `--max-new-tokens` new tokens per row (the engine ignores EOS, `generate()` gets
`min_new_tokens`). Alternating the two exposes both to the same load from other processes; the
table shows the best repeat of each and the range of the per-repeat ratios. The engine also
returns per-token logprobs and routed experts, which `generate()` does not compute. With `--url`
the baseline needs `--model-dir` (the model the engine serves).
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from typing import Callable

import torch

from moe_rl.bench.options import EngineBench
from moe_rl.engine.client import EngineClient
from moe_rl.engine.process import EmbeddedConfig, launch_embedded
from moe_rl.engine.sampling import SamplingParams

Baseline = Callable[[], tuple[float, int]]
"""Times one batched generate(): (seconds, new tokens)."""


def tiny_model_dir() -> str:
    # heavy: transformers, only to write the tiny model
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        architectures=["Qwen3MoeForCausalLM"],
    )
    path = tempfile.mkdtemp(prefix="moe-rl-bench-")
    Qwen3MoeForCausalLM(config).save_pretrained(path)
    return path


def make_prompts(requests: int, prompt_len: int) -> list[list[int]]:
    return [[(17 * i + j) % 200 + 1 for j in range(prompt_len)] for i in range(requests)]


def generate_baseline(model_dir: str, requests: int, prompt_len: int, max_new_tokens: int) -> tuple[str, Baseline]:
    """Load the model for transformers' batched `generate()` on the prompts `measure` sends, warm it
    up with one row; returns the device and the timing function."""
    # heavy: transformers, only for the baseline
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    prompts = make_prompts(requests, prompt_len)
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):  # left padding, as the engine's prefill
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    ids, mask = ids.to(device), mask.to(device)

    def generate(rows: int) -> torch.Tensor:
        # min_new_tokens = max_new_tokens: EOS never ends a row early (the engine's ignore_eos);
        # top_k=0 turns off transformers' default top-k of 50 (the engine sends top_k=-1)
        return model.generate(
            input_ids=ids[:rows],
            attention_mask=mask[:rows],
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            pad_token_id=0,
        )

    def timed() -> tuple[float, int]:
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        output = generate(len(prompts))
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start, int(output[:, width:].numel())

    torch.manual_seed(0)
    generate(1)  # warm up, like the engine's first request
    return device, timed


async def measure(
    url: str, requests: int, prompt_len: int, max_new_tokens: int, repeats: int = 1, baseline: Baseline | None = None
) -> dict:
    client = EngineClient(url)
    prompts = make_prompts(requests, prompt_len)

    async def one(i: int) -> int:
        result = await client.generate(
            prompts[i],
            SamplingParams(max_new_tokens=max_new_tokens, sampling_seed=i, ignore_eos=True),
            return_routed_experts=True,
        )
        return len(result.output_ids)

    concurrent, generated = [], []  # (seconds, tokens) per repeat
    try:
        await one(0)  # warm up
        start = time.perf_counter()
        serial_tokens = sum([await one(i) for i in range(requests)])
        serial_s = time.perf_counter() - start
        for _ in range(repeats):
            start = time.perf_counter()
            tokens = sum(await asyncio.gather(*(one(i) for i in range(requests))))
            concurrent.append((time.perf_counter() - start, tokens))
            if baseline:  # the engine idles meanwhile: generate() has the machine the engine had
                generated.append(baseline())
    finally:
        await client.close()
    report = {
        "requests": requests,
        "prompt_len": prompt_len,
        "max_new_tokens": max_new_tokens,
        "repeats": repeats,
        "serial_s": round(serial_s, 3),
        "serial_tok_per_s": round(serial_tokens / serial_s, 1),
        "serial_tokens": serial_tokens,
        **_best("concurrent", concurrent),
    }
    report["speedup"] = round(serial_s / report["concurrent_s"], 2)
    if generated:
        report |= _best("generate", generated)
        report["vs_generate"] = round(report["concurrent_tok_per_s"] / report["generate_tok_per_s"], 2)
        report["vs_generate_per_repeat"] = [round(g[0] / c[0], 2) for c, g in zip(concurrent, generated)]
    return report


def _best(name: str, runs: list[tuple[float, int]]) -> dict:
    seconds, tokens = min(runs)
    return {
        f"{name}_s": round(seconds, 3),
        f"{name}_tok_per_s": round(tokens / seconds, 1),
        f"{name}_tokens": tokens,
        f"{name}_all_s": [round(s, 3) for s, _ in runs],
    }


def run(options: EngineBench) -> dict:
    """The report: serial and concurrent rows, and generate()'s where there is a baseline."""
    device, baseline = None, None
    shape = (options.requests, options.prompt_len, options.max_new_tokens)
    if options.url:
        if options.model_dir:
            device, baseline = generate_baseline(options.model_dir, *shape)
        report = asyncio.run(measure(options.url, *shape, options.repeats, baseline))
    else:
        model_dir = options.model_dir or tiny_model_dir()
        with launch_embedded(EmbeddedConfig(model_path=model_dir, max_batch=max(64, options.requests))) as engine:
            device, baseline = generate_baseline(model_dir, *shape)
            report = asyncio.run(measure(engine.url, *shape, options.repeats, baseline))
    if device:
        report["generate_device"] = device
    return report


def show(report: dict) -> None:
    """The report as a table."""
    device = report.get("generate_device")
    print(
        f"{report['requests']} requests x {report['max_new_tokens']} new tokens (prompt {report['prompt_len']}), "
        f"best of {report['repeats']} concurrent{' and generate()' if device else ''} runs"
    )
    for label, key in [("serial", "serial"), ("concurrent", "concurrent"), ("generate()", "generate")]:
        if f"{key}_s" in report:
            print(
                f"  {label:10s} {report[key + '_s']:8.2f} s  {report[key + '_tok_per_s']:9.1f} tok/s  "
                f"{report[key + '_tokens']:7d} tokens"
            )
    print(f"  speedup    {report['speedup']:8.2f}x  concurrent vs serial")
    if "vs_generate" in report:
        ratios = report["vs_generate_per_repeat"]
        print(
            f"  vs generate() {report['vs_generate']:5.2f}x  concurrent vs transformers' generate() at batch "
            f"{report['requests']} ({device}); per repeat {min(ratios):.2f}-{max(ratios):.2f}x"
        )
