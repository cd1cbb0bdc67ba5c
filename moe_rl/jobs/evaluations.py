"""The RL driver's side of evaluation: when to ask for one, and where finished ones go.

The rollout worker runs the evaluations (`moe_rl.rollout.evaluation`); the driver asks for one
after the engines serve a version that `eval` makes due, and logs each finished evaluation as a
metrics row at the step it evaluated (metrics.jsonl, TensorBoard, W&B), its samples into
`RUN_DIR/eval/<name>/step_N.jsonl` (`SampleDump`). With `hold_sync` (`rl.mode: sync`, or
`eval.hold_sync`) the driver waits for a running evaluation before the next weight sync (the
trainer trains meanwhile), so no eval sample is restarted; otherwise it never waits during
training, only before a run checkpoint (so every evaluation of a step before the checkpoint is
logged before it: `--resume` neither loses nor repeats one) and at the end.
"""

from __future__ import annotations

from pathlib import Path

from moe_rl.metrics import MetricsLogger
from moe_rl.rollout.dump import SampleDump
from moe_rl.rollout.eval_config import EvalConfig


class DriverEvaluations:
    def __init__(self, config: EvalConfig | None, cluster, logger: MetricsLogger, run_dir: Path, hold_sync: bool):
        self.config, self.cluster, self.logger = config, cluster, logger
        self.run_dir, self.hold_sync = run_dir, hold_sync
        self.in_flight = 0

    def dumps(self, name: str) -> SampleDump:
        return SampleDump(self.run_dir / "eval" / name)

    def remove_after(self, step: int) -> None:
        """--resume: the evaluations of steps after the run checkpoint are redone."""
        for dataset in self.config.datasets if self.config else []:
            self.dumps(dataset.name).remove_after(step)

    def step_done(self, step: int, last: int) -> dict[str, float]:
        """The engines serve version `step`: ask for its evaluation if due, log the finished ones;
        returns the step's `eval/in_flight` (evaluations running or queued, for the step time)."""
        if self.config is None:
            return {}
        if self.config.due(step, last):
            self.cluster.start_eval()
        self.collect()
        return {"eval/in_flight": self.in_flight}

    def before_sync(self) -> None:
        """With `hold_sync`: the running evaluations end before the weights change under them."""
        if self.hold_sync and self.in_flight:
            self.collect(wait=True)

    def collect(self, wait: bool = False) -> None:
        """Log and dump the evaluations finished so far (`wait`: all of them)."""
        if self.config is None:
            return
        results, self.in_flight = self.cluster.finished_evals(wait)
        for result in results:
            self.logger.log(result.step, result.metrics)
            if self.config.dump:
                self.dumps(result.name).write(result.step, result.records)
