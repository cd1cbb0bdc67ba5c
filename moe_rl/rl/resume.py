"""Run checkpoints of the RL job: everything `moe-rl train --resume RUN_DIR` needs to continue.

    RUN_DIR/checkpoints/step_000012/
        trainer/      Megatron dist checkpoint: model, optimizer, RNG, trainer step
        state.json    step = weight version, metrics offset
        rollout.json  `RolloutManager.snapshot()`: completed groups waiting in the buffer, the
                      ledger, the data position, and every group still generating with its
                      partial samples (continued from their tokens on resume)

Written into `step_N.tmp/` and renamed when complete (a crash leaves no half checkpoint under a
final name); only the newest `rl.keep_checkpoints` are kept. The step-N checkpoint is taken after
step N's weights reached the engines, so resuming means: trainer state at N, engines started on
the trainer's version-N weights (announced as weight version N), buffer and ledger as they were,
metrics rows and trained-group records after step N dropped (those steps are redone).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import ray

from parallel.staging import fresh_staging, publish

CHECKPOINTS = "checkpoints"
TRAINED_FILE = "trained.jsonl"
"""One row per step: {"step": N, "groups": [group ids trained at step N]}."""


@dataclass(frozen=True)
class RunCheckpoint:
    """What a resumed run starts from (read by `load_run_checkpoint`)."""

    step: int
    """RL steps done: the loop continues at step + 1."""
    weight_version: int
    """The version the engines start serving (the trainer's weights at `step`)."""
    metrics_offset: int
    """Metrics rows (and trained-group records) up to this step are kept; later ones are redone."""
    trainer_dir: str
    """The Megatron dist checkpoint the trainer ranks load."""
    rollout: dict
    """`RolloutManager.snapshot()` as saved: buffer, ledger, data position, partial groups."""


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINTS / f"step_{step:06d}"


def latest_checkpoint(run_dir: str | Path) -> Path:
    """The newest complete run checkpoint under `run_dir`; ValueError when there is none."""
    done = sorted(p for p in (Path(run_dir) / CHECKPOINTS).glob("step_*") if not p.name.endswith(".tmp"))
    if not done:
        raise ValueError(
            f"--resume {str(run_dir)!r}: no run checkpoint under {CHECKPOINTS}/ (the run needs rl.checkpoint_every > 0)"
        )
    return done[-1]


def save_run_checkpoint(cluster, run_dir: Path, step: int, keep: int) -> Path:
    """Collective on the trainer; snapshots the rollout worker between two steps."""
    final = checkpoint_dir(run_dir, step)
    staging = fresh_staging(final)
    cluster.trainer.save_checkpoint(str(staging / "trainer"))
    rollout = ray.get(cluster.rollout.snapshot.remote())
    (staging / "rollout.json").write_text(json.dumps(rollout))
    (staging / "state.json").write_text(json.dumps({"step": step, "weight_version": step, "metrics_offset": step}))
    publish(staging, final)
    for old in sorted(p for p in final.parent.glob("step_*") if not p.name.endswith(".tmp"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_run_checkpoint(path: Path) -> RunCheckpoint:
    """A run checkpoint's state (the trainer part stays on disk for the ranks to load)."""
    state = json.loads((path / "state.json").read_text())
    return RunCheckpoint(
        step=state["step"],
        weight_version=state["weight_version"],
        metrics_offset=state["metrics_offset"],
        trainer_dir=str(path / "trainer"),
        rollout=json.loads((path / "rollout.json").read_text()),
    )


def truncate_rows(path: Path, last_step: int) -> None:
    """Keep the JSON lines of steps <= last_step (rows written after the checkpoint are redone)."""
    if not path.is_file():
        return
    rows = [line for line in path.read_text().splitlines() if line.strip()]
    kept = []
    for number, line in enumerate(rows, 1):
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            if number == len(rows):  # torn by the crash: a row after the checkpoint, redone anyway
                break
            raise ValueError(
                f"{path}: line {number} is not a metrics row ({line[:80]!r}); "
                "fix or remove that line, then --resume again"
            ) from None
        if step <= last_step:
            kept.append(line)
    path.write_text("".join(line + "\n" for line in kept))


def record_trained(run_dir: Path, step: int, group_ids: list[str]) -> None:
    with open(run_dir / TRAINED_FILE, "a") as f:
        f.write(json.dumps({"step": step, "groups": group_ids}) + "\n")
