"""`moe-rl bench train CONFIG [--lengths SPEC] [--steps N]`: the trainer's throughput on a
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

COMMAND = ("bench", "train")
HELP = "trainer throughput on long-tailed RL batches: padded vs token-budget micro-batches"


def add_arguments(parser) -> None:
    parser.add_argument("config", help="run config with trainer.max_tokens_per_microbatch (configs/bench/train_*.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.max_tokens_per_microbatch=2048")
    parser.add_argument("--lengths", default="", help="rows=512,prompt=16,median=48,cap=384,sigma=1.0,seed=0 (any)")
    parser.add_argument("--steps", type=int, default=3, help="timed train steps per path, after one warm-up")
    parser.add_argument("--output", default="bench_train.json", help="where the JSON goes")


def run(args) -> int:
    # heavy: torch (through moe_rl.config); the CLI imports every command module to build its parser
    import ray

    from moe_rl.config import load_config
    from moe_rl.rl.rollout_actor import TrainBatch
    from moe_rl.rollout.train_batch import build_batch, tensor_bytes
    from moe_rl.trainer.throughput import LengthSpec, computed_inputs, measure, synthetic_groups
    from parallel.model import use_transformer_engine
    from parallel.world import spawn

    spec = LengthSpec.parse(args.lengths)
    config = load_config(args.config, [*args.overrides, f"trainer.global_batch_size={spec.rows}"])
    trainer, budget = config.trainer, config.trainer.max_tokens_per_microbatch
    if budget is None or budget < spec.prompt + spec.cap:
        raise ValueError(
            f"trainer.max_tokens_per_microbatch={budget}: the bench needs a budget of at least the longest row, "
            f"prompt + cap = {spec.prompt + spec.cap} tokens; set it in {args.config}"
        )
    hf_config = config.model.load_hf_config()
    routing = None
    if trainer.routing_replay:
        text = hf_config.get_text_config()
        experts = getattr(text, "num_experts", None) or getattr(text, "n_routed_experts")
        routing = (text.num_hidden_layers, text.num_experts_per_tok, experts)
    batch, info = build_batch(synthetic_groups(spec, hf_config.vocab_size, routing), config.algorithm, version=0)
    real = sum(n - 1 for n in [spec.prompt + r for r in spec.response_lengths()])
    multiple = trainer.tp if trainer.sequence_parallel else 1
    # what the RL driver holds per step: the batch's metadata and the ref of its tensors (moe_rl.rl)
    batch_bytes = tensor_bytes(batch)
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
        ranks = spawn(measure, trainer.world_size, layout, hf_config, batch, config.algorithm, args.steps)
        step_s = max(r["step_s"] for r in ranks)
        computed = computed_inputs(batch, trainer.dp, trainer.micro_batch_size, path_budget, multiple, pack)
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
    Path(args.output).write_text(json.dumps(results, indent=2))
    print(
        f"dynamic / padded real tokens/s: {speedup:.2f}x; driver bytes {driver:,} of {batch_bytes:,} "
        f"({driver / batch_bytes:.2%}); wrote {args.output}"
    )
    return 0
