"""Print one step of a sample dump (`moe_rl.rollout.dump`) with rich: `moe-rl samples RUN_DIR`.

One panel per sample: reward, advantage, staleness, versions, status and tokens on a line, then
the prompt (its end: where the question sits) and the response (its start and end), shortened.
Texts are shown as plain text (rich markup in a model's output is not interpreted).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from rich.console import Console, Group
from rich.panel import Panel
from rich.text import Text

from moe_rl.rollout.dump import EVAL_DIR, ROLLOUTS_DIR, SampleDump, describe_steps

PROMPT_CHARS = 400
"""The prompt's last characters shown."""
RESPONSE_HEAD, RESPONSE_TAIL = 800, 300
"""The response's first and last characters shown (all of it when shorter than both)."""

Order = Literal["worst", "best"]


def dump_dir(run_dir: str | Path, eval_name: str | None = None) -> SampleDump:
    """The dump of `run_dir`'s trained samples, or of its evaluation `eval_name`; ValueError with
    the fix when the run directory or the dump is missing."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"{str(run_dir)!r} is not a directory: give a run directory written by `moe-rl train`")
    if eval_name is None:
        dump = SampleDump(run_dir / ROLLOUTS_DIR)
        if not dump.steps():
            raise ValueError(
                f"no rollout dumps in {dump.directory}: set rollout.dump: true in the run's config "
                "(or `moe-rl train CONFIG rollout.dump=true`)"
            )
        return dump
    dump = SampleDump(run_dir / EVAL_DIR / eval_name)
    if not dump.steps():
        names = sorted(p.name for p in (run_dir / EVAL_DIR).glob("*") if p.is_dir())
        raise ValueError(f"no eval dumps in {dump.directory}: evaluations with dumps here: {names or 'none'}")
    return dump


def show_step(
    run_dir: str | Path,
    *,
    step: int | None = None,
    order: Order | None = None,
    limit: int = 8,
    eval_name: str | None = None,
    console: Console | None = None,
) -> None:
    """Print `limit` samples of `step` (None: the newest), in dump order or sorted by reward."""
    if limit < 1:
        raise ValueError(f"--limit {limit}: give at least 1")
    dump = dump_dir(run_dir, eval_name)
    steps = dump.steps()
    step = steps[-1] if step is None else step
    if step not in steps:
        raise ValueError(f"no step {step} in {dump.directory}: steps there are {describe_steps(steps)}")
    records = dump.read(step)
    if order is not None:  # samples without a reward go last either way
        records.sort(
            key=lambda r: (r.get("reward") is None, (r.get("reward") or 0.0) * (1 if order == "worst" else -1))
        )
    shown = records[:limit]
    console = console or Console()
    how = f", {order} first" if order else ""
    console.print(Text(f"step {step}: {len(shown)} of {len(records)} samples{how}  ({dump.directory})", style="bold"))
    for record in shown:
        console.print(sample_panel(record))


def sample_panel(record: dict[str, Any]) -> Panel:
    title = f"group {record.get('group_id')}  #{record.get('index', '?')}"
    if record.get("task") is not None:  # a mixture's task (`rollout.tasks`)
        title += f"  task {record['task']}"
    body = Group(
        Text(_summary(record), style="cyan"),
        Text("prompt: ", style="bold").append(_tail(record.get("prompt_text", ""), PROMPT_CHARS), style="default"),
        Text("response: ", style="bold").append(_middle_cut(record.get("response_text", "")), style="default"),
    )
    return Panel(body, title=title, title_align="left")


def _summary(record: dict[str, Any]) -> str:
    parts = [
        f"reward {_number(record.get('reward'))}",
        f"advantage {_number(record.get('advantage'))}",
        f"staleness {record.get('staleness')}",
        f"versions {_versions(record.get('versions') or [])}",
        f"status {record.get('status')}",
        f"segments {record.get('segments')}",
        f"tokens {record.get('response_tokens')} ({record.get('loss_mask_tokens')} trained)",
    ]
    if record.get("answer") is not None:
        parts.append(f"answer {str(record['answer'])[:40]!r}")
    episode = record.get("episode")
    if episode:
        parts.append(f"turns {episode['turns']}  tool calls {episode['tool_calls']}")
    return "  ".join(parts)


def _versions(ranges: list[list]) -> str:
    """[[0, 5, 3], [5, 8, None], [8, 12, 4]] -> 'v3 x5, env x3, v4 x4'."""
    return ", ".join(f"{'env' if v is None else f'v{v}'} x{end - start}" for start, end, v in ranges) or "-"


def _number(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def _tail(text: str, chars: int) -> str:
    return text if len(text) <= chars else f"[... {len(text) - chars} chars] " + text[-chars:]


def _middle_cut(text: str) -> str:
    if len(text) <= RESPONSE_HEAD + RESPONSE_TAIL:
        return text
    cut = len(text) - RESPONSE_HEAD - RESPONSE_TAIL
    return f"{text[:RESPONSE_HEAD]} [... {cut} chars] {text[-RESPONSE_TAIL:]}"
