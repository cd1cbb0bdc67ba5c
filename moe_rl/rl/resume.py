"""Run checkpoints of the RL job: everything `moe-rl train --resume RUN_DIR` needs to continue.

    RUN_DIR/checkpoints/step_000012/
        trainer/      Megatron dist checkpoint: model, optimizer, RNG, trainer step
        state.json    step = weight version, metrics offset
        rollout.json  `RolloutManager.snapshot()`: completed groups waiting in the buffer, the
                      ledger, the data position, the task mixture, and every group still
                      generating with its partial samples (continued from their tokens on resume)

Written into `step_N.tmp/` and renamed when complete (a crash leaves no half checkpoint under a
final name); only the newest `rl.keep_checkpoints` are kept. With `rl.checkpoint_background` the
trainer's tensors are written by background writers while training goes on (the state as it was
at step N); the run checkpoint is renamed into place when they are done, at a later step.
The step-N checkpoint is taken after step N's weights reached the engines, so resuming means:
trainer state at N, engines started on the trainer's version-N weights (announced as weight
version N), buffer and ledger as they were, metrics rows and trained-group records after step N
dropped (those steps are redone).
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


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """The complete run checkpoints under `run_dir`, oldest first (not the `.tmp` ones being written)."""
    return sorted(p for p in (Path(run_dir) / CHECKPOINTS).glob("step_*") if not p.name.endswith(".tmp"))


def latest_checkpoint(run_dir: str | Path) -> Path:
    """The newest complete run checkpoint under `run_dir`; ValueError when there is none."""
    done = complete_checkpoints(run_dir)
    if not done:
        raise ValueError(
            f"--resume {str(run_dir)!r}: no run checkpoint under {CHECKPOINTS}/ (the run needs rl.checkpoint_every > 0)"
        )
    return done[-1]


class RunCheckpointer:
    """Writes the run checkpoints of one start of the run's processes (the driver's side)."""

    def __init__(self, cluster, run_dir: Path, keep: int, background: bool):
        self.cluster, self.run_dir, self.keep, self.background = cluster, run_dir, keep, background
        self.writing: dict[str, tuple[Path, Path]] = {}  # trainer directory -> (staging, final)

    def save(self, step: int) -> None:
        """The run at `step` (between two steps): the trainer's state (collective; in the
        background with `background`), the rollout worker's snapshot, the step's numbers."""
        final = checkpoint_dir(self.run_dir, step)
        staging = fresh_staging(final)
        trainer = str(staging / "trainer")
        self.cluster.trainer.save_checkpoint(trainer, self.background)
        rollout = ray.get(self.cluster.rollout.snapshot.remote())
        (staging / "rollout.json").write_text(json.dumps(rollout))
        (staging / "state.json").write_text(json.dumps({"step": step, "weight_version": step, "metrics_offset": step}))
        self.writing[trainer] = (staging, final)
        if not self.background:
            self.complete()

    def complete(self, blocking: bool = False) -> None:
        """Put the run checkpoints whose trainer part is written into place (`blocking`: wait for
        all), then keep the newest `keep`."""
        if not self.writing:
            return
        done = list(self.writing) if not self.background else self.cluster.trainer.finish_checkpoints(blocking)
        for trainer in done:
            staging, final = self.writing.pop(trainer)
            publish(staging, final)
        for old in complete_checkpoints(self.run_dir)[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)


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


def check_mixture(signature: list[list] | None, checkpoint: RunCheckpoint) -> None:
    """The run's task mixture (`RolloutConfig.mixture_signature`) is the checkpoint's: the prompts a
    resume replays and draws depend on its names and weights (`moe_rl.tasks.mixture`)."""
    saved = checkpoint.rollout.get("mixture")
    if saved != signature:
        raise ValueError(
            f"rollout.tasks: the run checkpoint was written with the mixture {saved} ([name, weight] in order), "
            f"the config has {signature}; resume with the same tasks and weights, or start a new run"
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
    # a new file renamed over the old one: a crash mid-write, or a reader meanwhile, never sees half
    temporary = path.with_suffix(path.suffix + ".tmp")
    temporary.write_text("".join(line + "\n" for line in kept))
    temporary.replace(path)


def read_rows(path: Path) -> list[dict]:
    """The rows of a JSON lines file of the run (metrics, trained groups); a torn row is skipped."""
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def steps_after(path: Path, last_step: int) -> int:
    """How many steps after `last_step` have rows in the JSON lines file `path` (a step may have
    several: an evaluation logs a row of its own)."""
    return len({row["step"] for row in read_rows(path) if row.get("step", 0) > last_step})


def record_trained(run_dir: Path, step: int, group_ids: list[str]) -> None:
    with open(run_dir / TRAINED_FILE, "a") as f:
        f.write(json.dumps({"step": step, "groups": group_ids}) + "\n")
