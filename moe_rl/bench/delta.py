"""`moe-rl bench sync CONFIG` with a `delta:` section (options: `moe_rl.bench.options.DeltaBench`):
how much of a served version changes bitwise from one RL step to the next, and what delta sync
(`sync.delta`) sends for it.

Trainer: a tiny Qwen3-MoE (transformers, `model`'s Qwen3MoeConfig fields) with fp32 master weights,
trained by torch.optim.Adam on a policy-gradient loss: random token sequences, an advantage of +1
or -1 per sequence, loss = -(advantage x log-prob of each next token).mean(). After every step the
served weights are exported in HF checkpoint names (experts one by one): "bf16" casts every tensor;
"fp8" quantizes the decoder linear weights from the fp32 masters into FP8 e4m3 blocks of
`fp8_blocks` x `fp8_blocks` with their float32 `weight_scale_inv` (`parallel.fp8`), the rest bf16.

Per step, a `KeptCopy` encodes the export against the previous one (a full anchor at step 0 and
every `full_every` steps) and an `AppliedCopy`, the stand-in engine, applies it. Recorded per step:
changed_fraction (changed / all elements), wire_fraction (wire / dense bytes), encode_s, apply_s,
kept_bytes, anchor. The chain is checked at the end: the applied copy equals a fresh export of the
final weights bit for bit, FP8 values and scales included (chain_bit_equal). Medians are over the
delta steps (anchors apart). Every run starts from the same init and sees the same batches.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Iterator

import torch

from moe_rl.bench.options import DeltaBench, SyncBench
from parallel.fp8 import SCALE_SUFFIX, BlockFP8
from sync.config import DeltaConfig
from sync.delta import AppliedCopy, KeptCopy, bits


def hf_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's weights in HF checkpoint names: transformers fuses each layer's experts into
    `gate_up_proj` [E, 2I, H] (gate rows first) and `down_proj` [E, H, I]; checkpoints and engines
    name them `experts.{e}.gate_proj.weight` etc."""
    for name, tensor in model.state_dict().items():
        prefix, _, leaf = name.rpartition(".")
        if leaf == "gate_up_proj":
            gate, up = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                yield f"{prefix}.{e}.gate_proj.weight", gate[e]
                yield f"{prefix}.{e}.up_proj.weight", up[e]
        elif leaf == "down_proj" and tensor.dim() == 3:
            for e in range(tensor.shape[0]):
                yield f"{prefix}.{e}.down_proj.weight", tensor[e]
        else:
            yield name, tensor


def served(model: torch.nn.Module, fmt: str, blocks: int) -> list[tuple[str, torch.Tensor]]:
    """What an engine serving `fmt` holds: bf16 casts, or FP8 blocks + float32 scales and bf16 rest."""
    items = ((name, tensor.detach()) for name, tensor in hf_tensors(model))
    if fmt == "bf16":
        return [(name, tensor.to(torch.bfloat16)) for name, tensor in items]
    quantized = BlockFP8(blocks, blocks).quantize_stream(items)
    return [
        (name, t if t.dtype == torch.float8_e4m3fn or name.endswith(SCALE_SUFFIX) else t.to(torch.bfloat16))
        for name, t in quantized
    ]


def measure(model_fields: dict, options: DeltaBench, lr: float, fmt: str) -> dict:
    """One run: `options.steps` Adam steps at `lr`, each followed by a sync in `fmt`."""
    # heavy: transformers, only where an HF config or model is built
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(options.seed)
    config = Qwen3MoeConfig(**model_fields)
    model = Qwen3MoeForCausalLM(config).float()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    batches = torch.Generator().manual_seed(options.seed)
    kept, engine, steps = KeptCopy(), AppliedCopy(), []
    for step in range(options.steps):
        _train_step(model, optimizer, batches, options, config.vocab_size)
        anchor = step % options.full_every == 0
        payloads = list(kept.encode_stream(served(model, fmt, options.fp8_blocks), step, anchor, options.encoding))
        start = time.perf_counter()
        if anchor:
            engine.hold(dict(payloads), step)
        else:
            engine.apply_stream(payloads, step - 1)
        stats = kept.stats
        steps.append(
            dict(
                step=step,
                anchor=anchor,
                changed_fraction=stats.changed_fraction,
                wire_fraction=stats.wire_fraction,
                wire_bytes=stats.wire_bytes,
                dense_bytes=stats.dense_bytes,
                encode_s=stats.encode_s,
                apply_s=time.perf_counter() - start,
                kept_bytes=kept.nbytes,
            )
        )
    final = served(model, fmt, options.fp8_blocks)
    deltas = [s for s in steps if not s["anchor"]]

    def median(key: str) -> float | None:
        return statistics.median(s[key] for s in deltas) if deltas else None

    return dict(
        lr=lr,
        format=fmt,
        steps=steps,
        wire_fraction_median=median("wire_fraction"),
        changed_fraction_median=median("changed_fraction"),
        encode_s_median=median("encode_s"),
        apply_s_median=median("apply_s"),
        dense_bytes=steps[-1]["dense_bytes"],
        kept_bytes=kept.nbytes,
        anchors=len(steps) - len(deltas),
        chain_steps=options.steps - 1 - max(s["step"] for s in steps if s["anchor"]),
        chain_bit_equal=_bit_equal(dict(final), engine.tensors),
    )


def _train_step(model, optimizer, batches: torch.Generator, options: DeltaBench, vocab_size: int) -> None:
    """One policy-gradient step on random sequences with random +-1 advantages."""
    tokens = torch.randint(0, vocab_size, (options.batch_size, options.seq_len), generator=batches)
    advantages = torch.randint(0, 2, (options.batch_size, 1), generator=batches).float() * 2 - 1
    logits = model(input_ids=tokens).logits[:, :-1].float()
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    loss = -(advantages * logprobs).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def _bit_equal(expected: dict[str, torch.Tensor], held: dict[str, torch.Tensor]) -> bool:
    """The same names, dtypes, shapes and bits."""
    if expected.keys() != held.keys():
        return False
    for name, tensor in expected.items():
        other = held[name]
        if tensor.dtype != other.dtype or tensor.shape != other.shape:
            return False
        if not torch.equal(bits(tensor), bits(other)):
            return False
    return True


def machine() -> dict:
    """What the figures ran on."""
    cpu = next((line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")), None)
    return dict(
        cpu=cpu or platform.processor(),
        cores=len(os.sched_getaffinity(0)),
        torch_threads=torch.get_num_threads(),
        torch=torch.__version__,
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    )


def _cpuinfo() -> list[str]:
    path = Path("/proc/cpuinfo")
    return path.read_text().splitlines() if path.is_file() else []


def run(options: SyncBench) -> dict:
    """Every lr x format run, printed as it ends; written to `options.output_path`."""
    delta = options.delta
    DeltaConfig(enabled=True, full_every=delta.full_every, encoding=delta.encoding)  # the sync's own checks
    runs = []
    for lr in delta.lrs:
        for fmt in delta.formats:
            runs.append(measure(options.model, delta, lr, fmt))
            print(_row(runs[-1]), flush=True)
    result = dict(runs=runs, model=options.model, delta=dataclasses.asdict(delta), machine=machine())
    Path(options.output_path).write_text(json.dumps(result, indent=2))
    return result


HEADER = f"{'lr':>8} {'format':>6} {'changed':>8} {'wire':>8} {'anchors':>7} {'encode s':>9} {'apply s':>9}  bit-equal"


def _row(run: dict) -> str:
    if run["wire_fraction_median"] is None:  # anchors only
        return f"{run['lr']:8.0e} {run['format']:>6} {'-':>8} {'-':>8} {run['anchors']:7d}  {run['chain_bit_equal']}"
    return (
        f"{run['lr']:8.0e} {run['format']:>6} {run['changed_fraction_median']:8.2%} {run['wire_fraction_median']:8.2%} "
        f"{run['anchors']:7d} {run['encode_s_median']:9.4f} {run['apply_s_median']:9.4f}  {run['chain_bit_equal']}"
    )


def show(result: dict, output: str) -> None:
    """The runs as a table (medians over the delta steps; wire = wire / dense bytes)."""
    print(HEADER)
    for run in result["runs"]:
        print(_row(run))
    print(f"wrote {output}")
