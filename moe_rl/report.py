"""PNG plots of a run directory's `metrics.jsonl` (`moe-rl report RUN_DIR`, and the RL job's end).

Writes into `RUN_DIR/plots/`: `reward.png` (mean reward per step and a moving average; each task
of a mixture its own), `staleness.png` (histogram of sample staleness over the run),
`routing_agreement.png` (per-layer routing agreement between trainer and engine without replay,
and the consistency probe's),
`consistency.png` (the probe's logprob gap on the same weights against the off-policy gap, which
includes the policy's change: docs/algorithm.md), `time.png` (per-step time breakdown: trainer
wait, old logprobs, train step, drain, weight sync), `utilization.png` (per step, the fraction of
wall time each pool was busy, and the engines' paused and idle time: `perf/*`), and for agent
runs `agents.png` (turns, tool calls, tool errors, forked sequences and dropped groups per episode
and step),
`agent_time.png` (environment vs generation seconds per episode; trained vs masked tokens) and,
when the agent sets its own `episode.metrics`, `agent_metrics.png` (each one's moving average), and
for runs with `eval:` `eval.png` (per eval dataset: mean reward and pass@k against the step
evaluated), and for runs whose rollouts return routed experts `experts.png` (from `experts.jsonl`,
`moe_rl.rollout.expert_load`: each MoE layer's load per expert over the run as a layer x expert
heatmap, and each layer's max violation per step), and for runs with a step timeline (`trace.json`,
`moe_rl.trace`) `timeline.png` (one lane per process and thread over a few of the traced steps;
docs/rl.md says how to read it), and for speculative rollouts (`engines.speculative`)
`speculation.png` (draft acceptance rate and tokens per verifying forward per step). A plot whose
metrics the run did not log is skipped. Returns the paths. `write_comparison` draws the speculative
curves of several runs on one figure (`moe-rl report RUN_DIR OTHER_RUN_DIR...`).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from moe_rl.metrics import read_metrics
from moe_rl.rollout.expert_load import read_expert_load
from moe_rl.trace import TRACE_FILE, process_labels, read_trace


def write_report(run_dir: str | Path) -> list[Path]:
    # heavy: matplotlib, only when plots are written
    import matplotlib

    matplotlib.use("Agg")
    # heavy: matplotlib, only when plots are written
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").is_file():
        raise ValueError(f"{run_dir}: no metrics.jsonl; pass a run directory written by `moe-rl train`")
    rows = read_metrics(run_dir)
    out = run_dir / "plots"
    out.mkdir(exist_ok=True)
    written = []
    for name, plot in (
        ("reward", _reward),
        ("staleness", _staleness),
        ("routing_agreement", _routing),
        ("consistency", _consistency),
        ("time", _time),
        ("utilization", _utilization),
        ("agents", _agents),
        ("agent_time", _agent_time),
        ("agent_metrics", _agent_metrics),
        ("eval", _eval),
        ("speculation", _speculation),
    ):
        fig, ax = plt.subplots(figsize=(7, 4))
        if plot(ax, rows):
            fig.tight_layout()
            fig.savefig(out / f"{name}.png", dpi=100)
            written.append(out / f"{name}.png")
        plt.close(fig)
    load = read_expert_load(run_dir)
    if load:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        _experts(fig, axes, load)
        fig.tight_layout()
        fig.savefig(out / "experts.png", dpi=100)
        written.append(out / "experts.png")
        plt.close(fig)
    if (run_dir / TRACE_FILE).is_file():
        spans = read_trace(run_dir / TRACE_FILE)
        lanes = _lanes(spans)
        fig, ax = plt.subplots(figsize=(13, 1.2 + 0.38 * len(lanes)))
        if _timeline(ax, spans, lanes, process_labels(run_dir / TRACE_FILE)):
            fig.tight_layout()
            fig.savefig(out / "timeline.png", dpi=100)
            written.append(out / "timeline.png")
        plt.close(fig)
    return written


# span name -> colour: generation green, training blue, weight sync red, batch handling purple,
# waits grey, garbage-collector passes black; anything else (logging, evaluations, checkpoints, control calls) tan
_TIMELINE_COLOURS = {
    **dict.fromkeys(("decode", "speculate", "prefill", "requests in flight"), "tab:green"),
    **dict.fromkeys(
        ("train", "train step", "forward-backward", "optimizer", "old logprobs", "ref logprobs", "routing-off forward"),
        "tab:blue",
    ),
    **dict.fromkeys(("weight sync", "sync pause", "sync buckets", "sync commit", "sync resume"), "tab:red"),
    **dict.fromkeys(("build batch", "batch transfer"), "tab:purple"),
    "wait for batch": "lightgrey",
    **dict.fromkeys(("gc gen 0", "gc gen 1", "gc gen 2"), "black"),  # the process stops for them
}
_TIMELINE_STEPS = 3  # steps drawn: enough to see the overlap, few enough to read each span


def _lanes(spans: list[dict]) -> list[tuple[str, str]]:
    """The timeline's lanes, (process, lane) in trace order; async spans (groups) are not drawn."""
    return list(dict.fromkeys((s["process"], s["lane"]) for s in spans if "group" not in s and s["lane"] != "steps"))


def _timeline(ax, spans: list[dict], lanes: list[tuple[str, str]], labels: dict[str, str]) -> bool:
    """The first `_TIMELINE_STEPS` traced steps: a row per lane, each span a bar (nested spans drawn
    over the span that holds them), step boundaries as dashed lines; each process's first lane
    says its CPU use over the whole trace (`labels`)."""
    from matplotlib.patches import Patch  # heavy: matplotlib, only when plots are written

    steps = sorted((s for s in spans if s["lane"] == "steps"), key=lambda s: s["start"])[:_TIMELINE_STEPS]
    if not steps:
        return False
    start, end = steps[0]["start"], steps[-1]["end"]
    shown = [s for s in spans if "group" not in s and s["end"] > start and s["start"] < end and s["lane"] != "steps"]
    row = {lane: i for i, lane in enumerate(lanes)}
    for span in sorted(shown, key=lambda s: s["start"] - s["end"]):  # longest first: inner spans on top
        colour = _TIMELINE_COLOURS.get(span["name"], "tan")
        y = row[span["process"], span["lane"]]
        ax.broken_barh([(span["start"], span["end"] - span["start"])], (y - 0.4, 0.8), color=colour, edgecolor="none")
    for step in steps:
        ax.axvline(step["start"], color="black", linestyle="--", linewidth=0.6)
        ax.text(step["start"], -0.9, step["name"], fontsize=8)
    names, seen = [], set()
    for process, lane in lanes:
        share = f" [{labels[process]}]" if process in labels and process not in seen else ""
        names.append(f"{process}: {lane}{share}")
        seen.add(process)
    ax.set_yticks(range(len(lanes)), names, fontsize=8)
    ax.set_ylim(len(lanes) - 0.5, -1.2)
    ax.set_xlim(start, end)
    ax.set_xlabel("seconds from the trace's start")
    legend = {"generation": "tab:green", "training": "tab:blue", "weight sync": "tab:red"}
    legend.update({"batch build / transfer": "tab:purple", "waiting for the batch": "lightgrey"})
    legend.update({"garbage collector": "black", "other": "tan"})
    ax.legend(
        handles=[Patch(color=colour, label=label) for label, colour in legend.items()],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.12 - 1.5 / max(4, len(lanes))),
        ncol=7,
        fontsize=8,
    )
    ax.set_title(f"Step timeline ({len(steps)} steps; {TRACE_FILE} has every span)")
    return True


def _series(rows, key):
    points = sorted((r["step"], r[key]) for r in rows if key in r)  # eval rows may arrive late
    return [p[0] for p in points], [p[1] for p in points]


def _moving_average(values: list[float]) -> tuple[list[float], int]:
    """Each value's mean with the ones before it, over a twentieth of the run; and that window."""
    window = max(1, len(values) // 20)
    return [sum(values[max(0, i - window + 1) : i + 1]) / min(i + 1, window) for i in range(len(values))], window


SPECULATION = (
    ("rollout/spec_accept_rate", "draft acceptance rate"),
    ("rollout/spec_tokens_per_forward", "tokens per verify"),
)


def _speculation(ax, rows) -> bool:
    steps, accept = _series(rows, SPECULATION[0][0])
    if not steps:
        return False
    tokens_steps, tokens = _series(rows, SPECULATION[1][0])
    ax.plot(steps, accept, alpha=0.35, color="tab:blue")
    ax.plot(steps, _moving_average(accept)[0], color="tab:blue", label=SPECULATION[0][1])
    ax.set(xlabel="step", ylabel=SPECULATION[0][1], ylim=(0, 1.02), title="Speculative rollout")
    right = ax.twinx()
    right.plot(tokens_steps, _moving_average(tokens)[0], color="tab:orange", label=SPECULATION[1][1])
    right.set(ylabel=f"{SPECULATION[1][1]} (moving average)")
    ax.legend(loc="lower left")
    right.legend(loc="lower right")
    return True


def write_comparison(run_dirs: list[str | Path]) -> Path | None:
    """The speculative metrics of several runs side by side (one line per run, moving averages),
    into the first run's `plots/speculation_runs.png`; None when no run logged them."""
    # heavy: matplotlib, only when plots are written
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    drawn = False
    for run_dir in map(Path, run_dirs):
        rows = read_metrics(run_dir)
        for ax, (key, label) in zip(axes, SPECULATION):
            steps, values = _series(rows, key)
            if steps:
                ax.plot(steps, _moving_average(values)[0], label=run_dir.name)
                ax.set(xlabel="step", ylabel=label, title=f"{label} (moving average)")
                drawn = True
    if not drawn:
        plt.close(fig)
        return None
    for ax in axes:
        ax.legend()
    out = Path(run_dirs[0]) / "plots" / "speculation_runs.png"
    out.parent.mkdir(exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _reward(ax, rows) -> bool:
    steps, reward = _series(rows, "rollout/reward_mean")
    if not steps:
        return False
    smooth, window = _moving_average(reward)
    ax.plot(steps, reward, alpha=0.35, label="mean reward")
    ax.plot(steps, smooth, label=f"moving average ({window})")
    tasks = sorted({m[1] for r in rows for k in r if (m := re.fullmatch(r"rollout/task/([^/]+)/reward_mean", k))})
    for name in tasks:  # a task mixture's tasks (`rollout.tasks`), each its moving average
        task_steps, task_reward = _series(rows, f"rollout/task/{name}/reward_mean")
        task_smooth, task_window = _moving_average(task_reward)
        ax.plot(task_steps, task_smooth, linestyle="--", label=f"task {name} ({task_window})")
    ax.set(xlabel="step", ylabel="reward", title="Reward")
    ax.legend()
    return True


def _staleness(ax, rows) -> bool:
    counts: dict[int, float] = {}
    for row in rows:
        for key, value in row.items():
            if match := re.fullmatch(r"rollout/staleness_count/(\d+)", key):
                counts[int(match[1])] = counts.get(int(match[1]), 0) + value
    if not counts:
        return False
    ax.bar(list(counts), list(counts.values()))
    ax.set(
        xlabel="staleness (trainer version - oldest token version)",
        ylabel="samples",
        title="Staleness of trained samples",
    )
    ax.set_xticks(sorted(counts))
    return True


def _routing(ax, rows) -> bool:
    layers = sorted(
        {k for r in rows for k in r if k.startswith("routing/agreement/")}, key=lambda k: int(re.sub(r"\D", "", k) or 0)
    )
    for key in layers:
        steps, values = _series(rows, key)
        ax.plot(steps, values, label=key.rsplit("/", 1)[-1])
    steps, values = _series(rows, "consistency/probe/routing_agreement")
    if steps:
        ax.plot(steps, values, "k.", label="probe (same weights)")
    if not layers and not steps:
        return False
    ax.set(xlabel="step", ylabel="agreement (top-k overlap)", title="Routing agreement without replay")
    ax.legend(fontsize=7, ncol=2)
    return True


def _consistency(ax, rows) -> bool:
    """The probe's gap (same weights, same tokens) against the off-policy gap (rollout logprobs
    of older versions against the trainer's now), log scale: they differ by orders of magnitude."""
    lines = {
        "consistency/probe/logprob_diff_mean": ("probe mean (same weights)", "o-"),
        "consistency/probe/logprob_diff_max": ("probe max", "o:"),
        "offpolicy/logprob_diff_mean": ("off-policy mean (incl. policy change)", "-"),
        "offpolicy/logprob_diff_no_replay_mean": ("off-policy mean, no replay", "--"),
    }
    plotted = False
    for key, (label, style) in lines.items():
        points = [(step, value) for step, value in zip(*_series(rows, key)) if value > 0]  # log scale
        if points:
            ax.plot(*zip(*points), style, label=label, markersize=3)
            plotted = True
    if plotted:
        ax.set(xlabel="step", ylabel="|trainer - engine| logprob", yscale="log", title="Train/inference logprob gap")
        ax.legend(fontsize=8)
    return plotted


def _time(ax, rows) -> bool:
    parts = ["time/trainer_wait_s", "time/old_logprobs_s", "time/train_step_s", "time/drain_s", "time/sync_s"]
    parts = [p for p in parts if any(p in r for r in rows)]
    if not parts:
        return False
    bottom = None
    for key in parts:
        steps, values = _series(rows, key)
        ax.bar(steps, values, bottom=bottom, label=key.split("/")[1].removesuffix("_s"), width=1.0)
        bottom = values if bottom is None else [a + b for a, b in zip(bottom, values)]
    ax.set(xlabel="step", ylabel="seconds", title="Time per step")
    ax.legend(fontsize=8)
    return True


def _utilization(ax, rows) -> bool:
    steps, trainer = _series(rows, "perf/trainer_busy_frac")
    if not steps:
        return False
    _, engine = _series(rows, "perf/engine_busy_frac")
    _, idle = _series(rows, "perf/engine_idle_frac")
    paused = [1.0 - b - i for b, i in zip(engine, idle)]
    ax.plot(steps, trainer, label="trainer busy")
    ax.stackplot(
        steps,
        engine,
        paused,
        idle,
        labels=["engines busy", "engines paused", "engines idle"],
        colors=["tab:green", "tab:red", "lightgrey"],
        alpha=0.35,
    )
    ax.set(
        xlabel="step",
        ylabel="fraction of the step's wall time",
        ylim=(0, 1.02),
        title="Utilization: busy vs idle per pool",
    )
    ax.legend(fontsize=8, loc="lower right")
    return True


def _agents(ax, rows) -> bool:
    keys = {
        "agents/turns_per_episode": "turns / episode",
        "agents/tool_calls_per_episode": "tool calls / episode",
        "agents/tool_errors_per_episode": "tool errors / episode",
        "agents/forked_sequences": "forked sequences",
        "agents/truncated_episodes": "truncated episodes",
        "agents/dropped_agent_error": "groups dropped: agent_error",
        "agents/dropped_agent_timeout": "groups dropped: agent_timeout",
    }
    plotted = False
    for key, label in keys.items():
        steps, values = _series(rows, key)
        if steps and (key.endswith("_per_episode") or any(values)):
            ax.plot(steps, values, label=label)
            plotted = True
    if plotted:
        ax.set(xlabel="step", ylabel="count", title="Agent episodes")
        ax.legend(fontsize=8)
    return plotted


def _agent_metrics(ax, rows) -> bool:
    names = sorted({key for row in rows for key in row if key.startswith("agents/metric/")})
    for key in names:
        steps, values = _series(rows, key)
        smooth, window = _moving_average(values)
        ax.plot(steps, smooth, label=key.removeprefix("agents/metric/"))
    if names:
        ax.set(xlabel="step", ylabel=f"mean over episodes (moving average, {window} steps)", title="Agent metrics")
        ax.legend(fontsize=8)
    return bool(names)


def _agent_time(ax, rows) -> bool:
    steps, env = _series(rows, "agents/env_s_per_episode")
    if not steps:
        return False
    _, generate = _series(rows, "agents/generate_s_per_episode")
    ax.plot(steps, env, label="environment s / episode")
    ax.plot(steps, generate, label="generation s / episode")
    ax.set(xlabel="step", ylabel="seconds", title="Episode time; tokens trained vs masked")
    tokens = ax.twinx()
    for key, label, style in (
        ("rollout/trained_tokens", "trained tokens", ":"),
        ("rollout/masked_tokens", "masked tokens", "--"),
    ):
        t_steps, values = _series(rows, key)
        tokens.plot(t_steps, values, style, label=label, color="grey" if style == ":" else "black")
    tokens.set_ylabel("tokens per batch")
    lines = ax.get_legend_handles_labels(), tokens.get_legend_handles_labels()
    ax.legend(lines[0][0] + lines[1][0], lines[0][1] + lines[1][1], fontsize=8)
    return True


def _eval(ax, rows) -> bool:
    """Per eval dataset: mean reward and pass@k (the largest k and k = 1) against the step evaluated."""
    keys = sorted({k for r in rows for k in r if re.fullmatch(r"eval/[^/]+/(reward_mean|pass@\d+)", k)})
    if not keys:
        return False
    for name in sorted({k.split("/")[1] for k in keys}):
        passes = sorted((k for k in keys if k.startswith(f"eval/{name}/pass@")), key=lambda k: int(k.split("@")[1]))
        for key in [f"eval/{name}/reward_mean", *passes[:1], *passes[1:][-1:]]:
            steps, values = _series(rows, key)
            ax.plot(steps, values, marker="o", label=key.removeprefix("eval/"))
    ax.set(xlabel="step (policy version evaluated)", ylabel="held-out score", title="Evaluation")
    ax.legend(fontsize="small")
    return True


def _experts(fig, axes, load: list[dict]) -> None:
    """Left: each MoE layer's load per expert summed over the run, as a multiple of the mean (1 =
    balanced). Right: each layer's max violation (max / mean - 1) per step."""
    load = sorted(load, key=lambda row: row["step"])
    layers, steps = load[-1]["layers"], [row["step"] for row in load]
    counts = np.array([row["counts"] for row in load], dtype=np.float64)  # [steps, layers, experts]
    total = counts.sum(axis=0)
    relative = total / np.maximum(total.mean(axis=1, keepdims=True), 1e-12)
    violation = counts.max(axis=2) / np.maximum(counts.mean(axis=2), 1e-12) - 1  # [steps, layers]
    ticks = range(0, len(layers), max(1, len(layers) // 16))
    for ax, image, xlabel, title, label in (
        (axes[0], relative, "expert", "Expert load over the run", "load / mean load"),
        (axes[1], violation.T, "step", "Max violation per step", "max / mean - 1"),
    ):
        shown = ax.imshow(image, aspect="auto", interpolation="nearest", cmap="viridis")
        ax.set(xlabel=xlabel, ylabel="MoE layer (HF index)", title=title)
        ax.set_yticks(list(ticks), [str(layers[i]) for i in ticks])
        fig.colorbar(shown, ax=ax, label=label)
    experts = counts.shape[2]
    axes[0].set_xticks(list(range(0, experts, max(1, experts // 16))))
    step_ticks = range(0, len(steps), max(1, len(steps) // 10))
    axes[1].set_xticks(list(step_ticks), [str(steps[i]) for i in step_ticks])
