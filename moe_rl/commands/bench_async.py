"""`moe-rl bench async CONFIG`: what asynchrony and partial rollouts buy, measured end to end.

Runs the RL job on CONFIG (same model, layout, batch and `steps`) four times, each a full run
with its own Ray cluster and engines:
1. mode comparison on the config's own task: `sync` vs `fully_async`; reports the wall time of
   the training steps (start-up excluded) and the speedup;
2. long-tailed response lengths (task `copy_digits_long_tail`: responses stop at any of
   `num_stop_tokens` tokens, else run to `long_tail_max_new_tokens`): drain-before-sync
   (`one_step_off`) vs partial rollouts (`fully_async`, pause_mode abort, resume after the swap)
   at the same staleness bound 1; reports generated tokens/s and step throughput.
Writes every number to `output` (JSON) and prints a table.
"""

from __future__ import annotations

import json
from pathlib import Path

COMMAND = ("bench", "async")
HELP = "sync vs fully_async speedup, and partial rollouts vs drain-before-sync under long-tailed lengths"


def add_arguments(parser) -> None:
    parser.add_argument("config", help="RL run config (YAML with a rollout section), e.g. configs/demo_cpu.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted overrides applied to every run")
    parser.add_argument("--steps", type=int, default=40, help="RL steps per run")
    parser.add_argument("--long-tail-max-new-tokens", type=int, default=48)
    parser.add_argument("--num-stop-tokens", type=int, default=24, help="stop tokens of the long-tailed task")
    parser.add_argument("--output", default="runs/bench_async/results.json")


def _run(config_path: str, overrides: list[str], name: str, out: Path) -> dict:
    from moe_rl.config import load_config
    from moe_rl.jobs import rl

    config = load_config(config_path, [*overrides, f"output_dir={out / name}", "rl.report=false",
                                       "rl.save_hf=false"])
    summary = rl.run(config)
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    return {
        "mode": config.rl.mode, "steps": config.steps, "train_s": summary["train_s"],
        "steps_per_s": config.steps / summary["train_s"],
        "generated_tokens_per_s": last["rollout/generated_tokens_per_s"],
        "trained_tokens_per_s": sum(r["train/tokens"] for r in rows) / summary["train_s"],
        "reward_first": summary["reward_first"], "reward_last": summary["reward_last"],
        "resumed_requests": last["rollout/resumed_requests"],
        "mean_sync_s": sum(r["time/sync_s"] for r in rows) / len(rows),
        "mean_trainer_wait_s": sum(r["time/trainer_wait_s"] for r in rows) / len(rows),
        "mean_drain_s": sum(r.get("time/drain_s", 0.0) for r in rows) / len(rows),
        "mean_response_length": sum(r["rollout/response_length_mean"] for r in rows) / len(rows),
        "max_response_length": max(r["rollout/response_length_max"] for r in rows),
    }


def run(args) -> int:
    out = Path(args.output).parent
    base = [*args.overrides, f"steps={args.steps}"]
    tail = [*base, "rollout.task=copy_digits_long_tail", f"rollout.max_new_tokens={args.long_tail_max_new_tokens}",
            f"rollout.task_options={{length: 1, num_stop_tokens: {args.num_stop_tokens}}}",
            "rollout.max_staleness=1", "sync.pause_mode=abort", "rollout.partial_rollout=true"]
    runs = {
        "sync": _run(args.config, [*base, "rl.mode=sync", "rollout.max_staleness=0"], "sync", out),
        "fully_async": _run(args.config, [*base, "rl.mode=fully_async"], "fully_async", out),
        "long_tail_drain": _run(args.config, [*tail, "rl.mode=one_step_off"], "long_tail_drain", out),
        "long_tail_partial": _run(args.config, [*tail, "rl.mode=fully_async"], "long_tail_partial", out),
    }
    results = {
        "runs": runs,
        "speedup_fully_async_over_sync": runs["sync"]["train_s"] / runs["fully_async"]["train_s"],
        "partial_over_drain_generated_tokens_per_s":
            runs["long_tail_partial"]["generated_tokens_per_s"] / runs["long_tail_drain"]["generated_tokens_per_s"],
        "partial_over_drain_steps_per_s":
            runs["long_tail_partial"]["steps_per_s"] / runs["long_tail_drain"]["steps_per_s"],
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(results, indent=2))
    print(f"{'run':<18} {'train s':>8} {'steps/s':>8} {'gen tok/s':>10} {'wait s':>7} {'drain s':>8} {'resumed':>8}")
    for name, r in runs.items():
        print(f"{name:<18} {r['train_s']:8.1f} {r['steps_per_s']:8.2f} {r['generated_tokens_per_s']:10.0f} "
              f"{r['mean_trainer_wait_s']:7.3f} {r['mean_drain_s']:8.3f} {r['resumed_requests']:8.0f}")
    print(f"fully_async over sync: {results['speedup_fully_async_over_sync']:.2f}x (same steps); partial rollouts "
          f"over drain-before-sync (long tail): {results['partial_over_drain_generated_tokens_per_s']:.2f}x "
          f"generated tokens/s, {results['partial_over_drain_steps_per_s']:.2f}x steps/s; {args.output}")
    return 0
