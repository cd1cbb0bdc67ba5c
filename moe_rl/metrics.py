"""Run metrics: one JSON line per step in `metrics.jsonl`, TensorBoard scalars, optional W&B.

Only one process logs (the driver, or global rank 0 of a trainer world). Values must be numbers;
nested dicts are flattened to `a/b` keys. Rows may arrive out of step order (an evaluation of step
10 finishes during step 12): each row carries its step, and W&B plots against that `step` field
rather than its own monotonic counter.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


def flatten(values: dict[str, Any], prefix: str = "") -> dict[str, float]:
    flat: dict[str, float] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, prefix=f"{name}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            flat[name] = float(value)
    return flat


class MetricsLogger:
    def __init__(
        self,
        run_dir: str | Path,
        tensorboard: bool = True,
        wandb_project: str | None = None,
        config: dict | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a")
        self._tb = None
        if tensorboard:
            # heavy: tensorboard, only when metrics are logged
            from tensorboard.summary.writer.event_file_writer import EventFileWriter

            self._tb = EventFileWriter(str(self.run_dir / "tensorboard"))
        self._wandb = None
        if wandb_project:
            import wandb  # optional extra: pip install moe-rl[wandb]

            self._wandb = wandb.init(project=wandb_project, dir=str(self.run_dir), config=config)
            self._wandb.define_metric("step")
            self._wandb.define_metric("*", step_metric="step")

    def log(self, step: int, values: dict[str, Any]) -> None:
        flat = flatten(values)
        self._jsonl.write(json.dumps({"step": step, "time": time.time(), **flat}) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            self._tb.add_event(_scalars_event(step, flat))
        if self._wandb is not None:
            self._wandb.log({**flat, "step": step})

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _scalars_event(step: int, flat: dict[str, float]):
    """A row as one TensorBoard event holding every scalar: one record in the event file, where an
    event per scalar (SummaryWriter.add_scalar) cost the driver ~5 ms of its core a step in file
    appends (~150 scalars; without TensorFlow each record is an open-append-close)."""
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary

    values = [Summary.Value(tag=key, simple_value=value) for key, value in flat.items()]
    return Event(wall_time=time.time(), step=step, summary=Summary(value=values))


def read_metrics(run_dir: str | Path) -> list[dict[str, float]]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
