"""`moe-rl bench async CONFIG` (options: `moe_rl.bench.options.AsyncBench`): what asynchrony and
partial rollouts buy, measured end to end.

Runs the RL job on CONFIG (same model, layout, batch and `steps`) six times, each a full run with
its own Ray cluster and engines. By default on a machine with >= 2 cores the runs use disjoint
CPU pools (`cpu_pools`, the CPU picture of disaggregated GPU pools): one trainer rank
(trainer.world_size=1, no EP) on the first half of the cores, one engine on the rest; the cores
each process reports are printed. `--no-pools` keeps CONFIG's layout, unpinned.
1. `sync` vs `fully_async` on two workloads: "balanced" (`--balanced-max-new-tokens` chosen so
   generation takes about as long as the rest of a sync step) and "unbalanced" (CONFIG's own task,
   short responses: training dominates). Reports the wall time of the training steps (start-up
   excluded), the speedup, and its ideal from the sync run: with gen = the trainer's wait for the
   batch and train = the rest of the step, overlapping them at best turns gen + train into
   max(gen, train), so ideal = (gen + train) / max(gen, train) (2x when balanced); and the
   lockstep ideal, the same with the sync run's step-to-step spread (`overlap_ideal`);
2. long-tailed response lengths (task `copy_digits_long_tail`: responses stop at any of
   `num_stop_tokens` tokens, else run to `long_tail_max_new_tokens`): drain-before-sync
   (`one_step_off`, staleness bound 1) vs partial rollouts (`fully_async`, pause_mode abort,
   continued after the swap) at bound `--long-tail-staleness`: 1 by default, the same bound; 2 lets
   the trainer take the next round's finished groups and carry stragglers over into the next step
   (APRIL's setting). Reports generated tokens/s and step throughput, and the ideal (no drain wait:
   the drain run's step without its drain seconds).
3. agents (when CONFIG sets `rollout.agent`, instead of 1 and 2): `sync` vs `fully_async` on
   CONFIG's agent task with tools that take `--tool-latency-s` seconds a call (the task option
   `latency_s`, e.g. `lookup`): environment waits are where synchronous RL idles. Same report and
   ideal as 1.
Runs follow one another, so a ratio also measures how the machine's load moved between its two
runs; `--repeats N` runs every pair N times and reports the median ratio with its range.
Writes every number to `output` (JSON) and prints a table.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

from moe_rl.bench.options import AsyncBench
from moe_rl.config import load_config
from moe_rl.cpu_pools import available_cores
from moe_rl.jobs.preflight import check_run


def pool_overrides(cores: list[int]) -> list[str]:
    """One trainer rank (no EP) on the first half of `cores`, one engine on the other half."""
    half = len(cores) // 2
    trainer, engine = cores[:half], cores[half:]
    return [
        "trainer.world_size=1",
        "trainer.ep=1",
        "engines.count=1",
        f"cpu_pools={{trainer: {trainer}, engines: [{engine}]}}",
    ]


def _run(config_path: str, overrides: list[str], name: str, out: Path) -> dict:
    from moe_rl.jobs import rl  # heavy: Ray and megatron-core, only where a run starts

    config = load_config(config_path, [*overrides, f"output_dir={out / name}", "rl.report=false", "rl.save_hf=false"])
    summary = rl.run(config)
    # this run's steps: metrics.jsonl appends, so a reused --output also holds an earlier run's
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()][-config.steps :]
    last, n = rows[-1], len(rows)
    mean = lambda key: sum(r.get(key, 0.0) for r in rows) / n  # noqa: E731
    cores = out / name / "cpu_pools.json"
    return {
        "mode": config.rl.mode,
        "steps": config.steps,
        "train_s": summary["train_s"],
        "steps_per_s": config.steps / summary["train_s"],
        "generated_tokens_per_s": last["rollout/generated_tokens_per_s"],
        "trained_tokens_per_s": sum(r["train/tokens"] for r in rows) / summary["train_s"],
        "reward_first": summary["reward_first"],
        "reward_last": summary["reward_last"],
        "continued_requests": last["rollout/continued_requests"],
        "mean_step_s": mean("time/step_s"),
        "step_s": [r["time/step_s"] for r in rows],
        "trainer_wait_s": [r.get("time/trainer_wait_s", 0.0) for r in rows],
        "mean_sync_s": mean("time/sync_s"),
        "mean_trainer_wait_s": mean("time/trainer_wait_s"),
        "mean_train_step_s": mean("time/train_step_s"),
        "mean_drain_s": mean("time/drain_s"),
        # what bounds the step: the trainer's and the engines' busy fractions (moe_rl.jobs.rl perf/*)
        "trainer_busy_frac": mean("perf/trainer_busy_frac"),
        "engine_busy_frac": mean("perf/engine_busy_frac"),
        "mean_response_length": mean("rollout/response_length_mean"),
        "max_response_length": max(r["rollout/response_length_max"] for r in rows),
        "cores": json.loads(cores.read_text()) if cores.is_file() else None,
    }


def overlap_ideal(sync_run: dict) -> dict:
    """From a sync run: gen = the trainer's wait for its batch, train = the rest of the step, and
    the best fully_async can do by overlapping them, (gen + train) / max(gen, train).

    `lockstep_ideal`: the same with the sync run's step-to-step spread. Under staleness bound 1
    the engine generates round r + 1 while the trainer runs step r, and neither can run ahead of
    the other, so a step lasts the longer of that step's two sides: on average max(gen_i, train_j)
    over the sync run's steps i, j (paired every way: the two sides vary independently). A side
    that is late one step and early the next loses the difference, which `ideal` does not count."""
    gen = sync_run["mean_trainer_wait_s"]
    train = sync_run["mean_step_s"] - gen
    ideal = {"gen_s": gen, "train_s": train, "ideal": (gen + train) / max(gen, train)}
    gens = sync_run.get("trainer_wait_s")
    if gens:
        trains = [step - wait for step, wait in zip(sync_run["step_s"], gens)]
        ideal["lockstep_ideal"] = (gen + train) / statistics.mean(max(g, t) for g in gens for t in trains)
    return ideal


def run(options: AsyncBench) -> dict:
    """Every run's figures and the ratios (each repeat's and their spread); printed as a table
    and written to `options.output`."""
    out = Path(options.output).parent
    cores = sorted(available_cores())
    pools = options.pools
    if pools is None:
        pools = len(cores) >= 2 and load_config(options.config, options.overrides).cpu_pools is None
    if pools and len(cores) < 2:
        raise ValueError(f"--pools needs >= 2 cores, this process may use {cores}; pass --no-pools")
    base = [*(pool_overrides(cores) if pools else []), *options.overrides, f"steps={options.steps}"]
    print(f"cpu pools: {_describe_pools(load_config(options.config, base))} ({os.cpu_count()} cores here)", flush=True)
    balanced = [*base, f"rollout.max_new_tokens={options.balanced_max_new_tokens}"]
    tail = [
        *base,
        "rollout.task=copy_digits_long_tail",
        f"rollout.max_new_tokens={options.long_tail_max_new_tokens}",
        f"rollout.task_options={{length: 1, num_stop_tokens: {options.num_stop_tokens}}}",
        f"rollout.max_staleness={options.long_tail_staleness}",
        "sync.pause_mode=abort",
        "rollout.partial_rollout=true",
    ]
    sync, fully_async = ["rl.mode=sync", "rollout.max_staleness=0"], ["rl.mode=fully_async"]
    plan = {
        "balanced_sync": [*balanced, *sync],
        "balanced_fully_async": [*balanced, *fully_async],
        "unbalanced_sync": [*base, *sync],
        "unbalanced_fully_async": [*base, *fully_async],
        "long_tail_drain": [*tail, "rl.mode=one_step_off"],
        "long_tail_partial": [*tail, "rl.mode=fully_async"],
    }
    if load_config(options.config, options.overrides).rollout.agent is not None:
        tools = [*base, f"rollout.task_options.latency_s={options.tool_latency_s}"]
        plan = {"agent_sync": [*tools, *sync], "agent_fully_async": [*tools, *fully_async]}
    for overrides in plan.values():  # a bad option, override or input fails now, not after minutes of runs
        check_run(load_config(options.config, overrides))
    repeats = []  # each repeat runs every pair back to back, so both runs of a pair see about the same load
    for r in range(options.repeats):
        where = out if options.repeats == 1 else out / f"repeat{r}"
        runs = {name: _run(options.config, overrides, name, where) for name, overrides in plan.items()}
        repeats.append({"runs": runs, **_ratios(runs)})
    summary = {key: _spread([rep[key] for rep in repeats]) for key in repeats[0] if key != "runs"}
    results = {
        "pools": pools,
        "cores": cores,
        "long_tail_staleness": options.long_tail_staleness,
        "repeats": repeats,
        "summary": summary,
        "load_average": os.getloadavg(),
    }
    Path(options.output).parent.mkdir(parents=True, exist_ok=True)
    Path(options.output).write_text(json.dumps(results, indent=2))
    print(
        f"{'run':<23} {'train s':>8} {'steps/s':>8} {'gen tok/s':>10} {'step s':>7} {'wait s':>7} "
        f"{'drain s':>8} {'continued':>8} {'trainer busy':>13} {'engine busy':>12}"
    )
    for r, rep in enumerate(repeats):
        for name, run_ in rep["runs"].items():
            label = name if options.repeats == 1 else f"{name}#{r}"
            print(
                f"{label:<23} {run_['train_s']:8.1f} {run_['steps_per_s']:8.2f} {run_['generated_tokens_per_s']:10.0f} "
                f"{run_['mean_step_s']:7.3f} {run_['mean_trainer_wait_s']:7.3f} {run_['mean_drain_s']:8.3f} "
                f"{run_['continued_requests']:8.0f} {run_['trainer_busy_frac']:13.0%} {run_['engine_busy_frac']:12.0%}"
            )
    first = next(iter(plan))
    reported = repeats[0]["runs"][first]["cores"]
    if reported:
        print(
            f"cores the processes reported ({first}/cpu_pools.json): trainer ranks "
            f"{[r['cores'] for r in reported['trainer_ranks']]}, engines {reported['engines']}, "
            f"rollout worker {reported['rollout_worker']}"
        )
    for name in ("balanced", "unbalanced", "agent"):
        if name not in summary:
            continue
        w = summary[name]
        print(
            f"fully_async over sync, {name}: {_show(w, 'speedup')}, {_percent(w, 'of_ideal')} of the ideal "
            f"{_show(w, 'ideal')} (gen {w['gen_s']:.3f} s, train {w['train_s']:.3f} s per sync step); "
            f"{_percent(w, 'of_lockstep_ideal')} of {_show(w, 'lockstep_ideal')}, the ideal with the sync run's "
            "step-to-step spread"
        )
    if "long_tail" in summary:
        t = summary["long_tail"]
        print(
            f"partial rollouts (staleness bound {options.long_tail_staleness}) over drain-before-sync (bound 1), "
            f"long tail: {_show(t, 'steps_per_s')} steps/s "
            f"(ideal {_show(t, 'ideal_steps_per_s')}: no drain wait), {_show(t, 'generated_tokens_per_s')} "
            "generated tokens/s"
        )
    print(f"load average during the bench: {results['load_average'][1]:.2f} (5 min); {options.output}")
    return results


def _ratios(runs: dict) -> dict:
    """One repeat's ratios: fully_async over sync per workload (with its ideal), partial over drain."""
    ratios = {}
    for name in ("balanced", "unbalanced", "agent"):
        if f"{name}_sync" in runs:
            sync_run, async_run = runs[f"{name}_sync"], runs[f"{name}_fully_async"]
            ratios[name] = {"speedup": sync_run["train_s"] / async_run["train_s"], **overlap_ideal(sync_run)}
            for ideal in ("ideal", "lockstep_ideal"):
                if ideal in ratios[name]:
                    ratios[name][f"of_{ideal}"] = ratios[name]["speedup"] / ratios[name][ideal]
    if "long_tail_drain" not in runs:
        return ratios
    drain, partial = runs["long_tail_drain"], runs["long_tail_partial"]
    ratios["long_tail"] = {
        "generated_tokens_per_s": partial["generated_tokens_per_s"] / drain["generated_tokens_per_s"],
        "steps_per_s": partial["steps_per_s"] / drain["steps_per_s"],
        "ideal_steps_per_s": drain["mean_step_s"] / (drain["mean_step_s"] - drain["mean_drain_s"]),
    }
    return ratios


def _spread(values: list[dict]) -> dict:
    """Per key: the median over repeats, and every repeat's value (`<key>_all`)."""
    return {
        **{key: statistics.median(v[key] for v in values) for key in values[0]},
        **{f"{key}_all": [v[key] for v in values] for key in values[0]},
    }


def _show(summary: dict, key: str) -> str:
    """`1.52x`, or with repeats `1.52x (1.31-1.63)`: the median and the range."""
    values = summary[f"{key}_all"]
    spread = f" ({min(values):.2f}-{max(values):.2f})" if len(values) > 1 else ""
    return f"{summary[key]:.2f}x{spread}"


def _percent(summary: dict, key: str) -> str:
    """`88%`, or with repeats `88% (78-99%)`."""
    values = summary[f"{key}_all"]
    spread = f" ({100 * min(values):.0f}-{max(values):.0%})" if len(values) > 1 else ""
    return f"{summary[key]:.0%}{spread}"


def _describe_pools(config) -> str:
    """Which cores each side was given (the runs' cpu_pools.json has what each process reported)."""
    pools = config.cpu_pools
    if pools is None:
        return f"none (unpinned: trainer.world_size={config.trainer.world_size}, engines.count={config.engines.count})"
    ranks = "; ".join(
        f"trainer rank {i} on cores {cores} ({threads} threads)"
        for i, (cores, threads) in enumerate(pools.trainer_cores(config.trainer.world_size))
    )
    engines = "; ".join(f"engine {i} on cores {cores}" for i, cores in enumerate(pools.engines))
    return f"{ranks}; {engines}; rollout worker on {pools.rollout_cores}; driver and Ray on {pools.driver_cores}"
