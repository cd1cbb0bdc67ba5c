"""`StepClock`: the RL loop's timers and counters, so the loop reads as its steps.

One step of `moe_rl.jobs.rl`: `start()`, wait for the batch (`waited()` -> `time/trainer_wait_s`),
train inside `training()` (timed: colocated engines are released for it), update the weights, read
the rollout worker's counters, then `finish(metrics, rollout_metrics)` -> `time/step_s`, the
utilization of both pools (`utilization`, `perf/*`), `rollout/step_generated_tokens_per_s`, and with
speculative rollout (`speculation`) `rollout/spec_accept_rate` and `rollout/spec_tokens_per_forward`.
The engines' counters are cumulative; the clock keeps their previous values to take differences.
`TraceWindow`: which steps the timeline (`moe_rl.trace`) records.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from moe_rl.engine.pool import SPEC_COUNTERS
from moe_rl.trace import write_trace


class StepClock:
    def __init__(self, engine_active_s: float, *, colocate: bool, full_weight_sync: bool):
        """`engine_active_s`: the engines' active seconds before the first step (the rollout
        worker's `engines/active_s`). `colocate`: engines are released for the train step (those
        seconds count as paused). `full_weight_sync`: a sync pauses generation (not with LoRA,
        whose adapters load beside it)."""
        self.colocate, self.full_weight_sync = colocate, full_weight_sync
        self.active_s = engine_active_s
        self.generated_tokens = 0.0
        self.spec: dict[str, float] = {}
        self._start = self._released_s = 0.0

    def start(self) -> None:
        self._start, self._released_s = time.perf_counter(), 0.0

    def waited(self) -> dict[str, float]:
        """Right after the batch arrived: how long the trainer waited for it."""
        return {"time/trainer_wait_s": time.perf_counter() - self._start}

    @contextmanager
    def training(self) -> Iterator[None]:
        """Around the train step; colocated, its seconds are engine pause."""
        start = time.perf_counter()
        yield
        self._released_s = time.perf_counter() - start if self.colocate else 0.0

    def end(self, metrics: dict[str, float]) -> dict[str, float]:
        """The step's end (`metrics` holds its `time/sync_s`): its wall time and the seconds the
        engines were paused in it."""
        step_s = time.perf_counter() - self._start
        paused = self._released_s + (metrics["time/sync_s"] if self.full_weight_sync else 0.0)
        return {"time/step_s": step_s, "perf/engine_paused_s": min(step_s, paused)}

    def finish(self, metrics: dict[str, float], rollout_metrics: dict[str, float]) -> dict[str, float]:
        """The step's row, written once the rollout worker's counters are in (during the next
        step): the pools' utilization and the step's generation rate. `metrics` holds this step's
        `end`, `time/trainer_wait_s` (and `time/drain_s`)."""
        step_s = metrics["time/step_s"]
        active_s = rollout_metrics["engines/active_s"] - self.active_s
        out = utilization(metrics, active_s, metrics["perf/engine_paused_s"])
        self.active_s = rollout_metrics["engines/active_s"]
        new_tokens = rollout_metrics["rollout/generated_tokens"] - self.generated_tokens
        self.generated_tokens = rollout_metrics["rollout/generated_tokens"]
        out["rollout/step_generated_tokens_per_s"] = new_tokens / step_s
        return {**out, **self.speculation(rollout_metrics)}

    def speculation(self, rollout_metrics: dict[str, float]) -> dict[str, float]:
        """The step's speculative rates over the requests completed since the last step (none
        without speculation, or when no verifying forward completed): drafts accepted / proposed,
        and the tokens each verifying forward emitted (a request's first token, from its prefill,
        is not a verify's; a verify cut by the request's end emits fewer than accepted + 1)."""
        now = {name: rollout_metrics.get(f"rollout/{name}", 0) for name in SPEC_COUNTERS}
        verify, proposed, correct, tokens = (now[name] - self.spec.get(name, 0) for name in SPEC_COUNTERS)
        self.spec = now
        if verify <= 0:
            return {}
        return {
            "rollout/spec_accept_rate": correct / proposed if proposed else 0.0,
            "rollout/spec_tokens_per_forward": tokens / verify,
        }


def utilization(metrics: dict[str, float], engine_active_s: float, engine_paused_s: float) -> dict[str, float]:
    """Where one step's wall time went, per pool: what async RL exists to keep busy.

    Trainer: waiting for data (the batch, or a drain before the sync) or busy (everything else:
    old logprobs, the train step, the weight export and sync); busy + wait = the step. Engines
    (the mean engine): paused (a full-weight sync pauses generation; colocated engines are
    released for the train step too), busy (at least one request in flight outside the pause:
    `EnginePool.active_seconds`), or idle; busy + paused + idle = the step.
    """
    step = metrics["time/step_s"]
    wait = min(step, metrics["time/trainer_wait_s"] + metrics.get("time/drain_s", 0.0))
    paused = min(step, engine_paused_s)
    busy = min(step - paused, max(0.0, engine_active_s - paused))
    return {
        "perf/trainer_busy_frac": (step - wait) / step,
        "perf/trainer_wait_s": wait,
        "perf/engine_busy_frac": busy / step,
        "perf/engine_paused_s": paused,
        "perf/engine_idle_frac": (step - busy - paused) / step,
    }


class TraceWindow:
    """`rl.trace_steps`: the steps the timeline records (the `trace_steps` after a run's first,
    whose start-up costs are not typical), every process's tracer turned on before the first of
    them and collected into `path` after the last (`moe_rl.trace`)."""

    def __init__(self, cluster, path: Path, first: int, steps: int, trace_steps: int):
        """`cluster`: has `start_trace()` and `stop_trace()` (`RLCluster`); `first`: the version
        the run starts from (a resumed run records the steps after its first); `steps`: the last."""
        self.cluster, self.path = cluster, path
        self.versions = range(first + 1, min(first + 1 + trace_steps, steps))

    def begin(self, version: int) -> None:
        """Before the step that trains `version` + 1."""
        if self.versions and version == self.versions.start:
            self.cluster.start_trace()

    def end(self, version: int) -> None:
        """After that step is logged."""
        if self.versions and version == self.versions[-1]:
            write_trace(self.path, self.cluster.stop_trace())
