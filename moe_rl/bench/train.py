"""`moe-rl bench train CONFIG [--lengths SPEC] [--steps N]` (options: `moe_rl.bench.options.TrainBench`):
the trainer's throughput on a
long-tailed RL batch, padded micro-batches against token-budget ones (and packed ones where
Transformer Engine runs), in one call (`moe_rl.trainer.throughput`). Writes a JSON with one entry
per path (`padded`, `dynamic`, `packed`: skipped without TE), each
with `real_tokens_per_s`, `padding_fraction`, `peak_memory_bytes` and `step_s`, the speedup, and
`driver_bytes_fraction`: what the RL driver holds per step (the batch's metadata and an ObjectRef
of its tensors, `moe_rl.rl.rollout_actor.TrainBatch`) over the batch's tensor bytes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import ray

from moe_rl.bench.options import TrainBench
from moe_rl.config import load_config
from moe_rl.rl.rollout_actor import TrainBatch
from moe_rl.rollout.train_batch import build_batch
from moe_rl.trainer.throughput import LengthSpec, computed_inputs, measure, synthetic_groups
from parallel.model import use_transformer_engine
from parallel.world import spawn


def run(options: TrainBench) -> dict:
    """Every path's figures; printed as they come, and written to `options.output`."""
    spec = LengthSpec.parse(options.lengths)
    config = load_config(options.config, [*options.overrides, f"trainer.global_batch_size={spec.rows}"])
    trainer, budget = config.trainer, config.trainer.max_tokens_per_microbatch
    if budget is None or budget < spec.prompt + spec.cap:
        raise ValueError(
            f"trainer.max_tokens_per_microbatch={budget}: the bench needs a budget of at least the longest row, "
            f"prompt + cap = {spec.prompt + spec.cap} tokens; set it in {options.config}"
        )
    hf_config = config.model.load_hf_config()
    routing = None
    if trainer.routing_replay:
        text = hf_config.get_text_config()
        experts = getattr(text, "num_experts", None) or getattr(text, "n_routed_experts")
        routing = (text.num_hidden_layers, text.num_experts_per_tok, experts)
    batch, info = build_batch(synthetic_groups(spec, hf_config.vocab_size, routing), config.algorithm, version=0)
    real = sum(n - 1 for n in [spec.prompt + r for r in spec.response_lengths()])
    multiple = trainer.sequence_multiple
    # what the RL driver holds per step: the batch's metadata and the ref of its tensors (moe_rl.rl)
    batch_bytes = batch.tensor_bytes()
    driver = TrainBatch(ray.ObjectRef.from_random(), info, batch_bytes).driver_bytes()
    results = {
        "lengths": dataclasses.asdict(spec),
        "real_inputs": real,
        "budget": budget,
        "driver_bytes": driver,
        "batch_tensor_bytes": batch_bytes,
        "driver_bytes_fraction": driver / batch_bytes,
    }
    paths = [("padded", None, False), ("dynamic", budget, False)]
    # packing needs TE's attention (GPUs; the CPU local spec cannot pack), which packs in bf16 only
    skipped = None
    if not use_transformer_engine():
        skipped = "packed sequences need Transformer Engine on GPUs"
    elif trainer.precision == "fp32":
        skipped = "packed sequences on Transformer Engine need trainer.precision: bf16"
    if skipped is None:
        paths.append(("packed", budget, True))
    else:
        results["packed"] = {"skipped": skipped}
        print(f"packed   skipped: {skipped}", flush=True)
    for name, path_budget, pack in paths:
        layout = dataclasses.replace(trainer, max_tokens_per_microbatch=path_budget, pack_sequences=pack)
        ranks = spawn(measure, trainer.world_size, layout, hf_config, batch, config.algorithm, options.steps)
        step_s = max(r["step_s"] for r in ranks)
        computed = computed_inputs(batch.tensors(), trainer.dp, trainer.micro_batch_size, path_budget, multiple, pack)
        results[name] = {
            "step_s": step_s,
            "real_tokens_per_s": real / step_s,
            "padding_fraction": 1 - real / computed,
            "computed_inputs": computed,
            "peak_memory_bytes": max(r["peak_memory_bytes"] for r in ranks),
        }
        print(
            f"{name:8s} step {step_s:.3f} s  real tokens/s {real / step_s:,.0f}  padding {1 - real / computed:.1%}  "
            f"peak {results[name]['peak_memory_bytes'] / 2**20:.0f} MiB",
            flush=True,
        )
    speedup = results["dynamic"]["real_tokens_per_s"] / results["padded"]["real_tokens_per_s"]
    results["speedup_real_tokens_per_s"] = speedup
    Path(options.output).write_text(json.dumps(results, indent=2))
    print(
        f"dynamic / padded real tokens/s: {speedup:.2f}x; driver bytes {driver:,} of {batch_bytes:,} "
        f"({driver / batch_bytes:.2%}); wrote {options.output}"
    )
    return results
