"""`StepClock`: one RL step's timings and the pools' utilization, on a clock the test sets."""

from __future__ import annotations

import pytest

from moe_rl.rl import step_clock
from moe_rl.rl.step_clock import StepClock


class FakeTime:
    def __init__(self):
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


@pytest.mark.parametrize("colocate, full_weight_sync", [(False, True), (True, True), (False, False)])
def test_a_step_adds_up(monkeypatch, colocate, full_weight_sync):
    clock_time = FakeTime()
    monkeypatch.setattr(step_clock, "time", clock_time)
    clock = StepClock(5.0, colocate=colocate, full_weight_sync=full_weight_sync)
    clock.start()
    clock_time.now += 1.0  # waiting for the batch
    metrics = clock.waited()
    with clock.training():
        clock_time.now += 2.0  # the train step
    clock_time.now += 1.0  # the weight sync
    metrics.update({"time/sync_s": 1.0, "time/drain_s": 0.0})
    metrics.update(clock.end(metrics))
    clock.start()  # the next step starts before this one's row is written
    rollout = {"engines/active_s": 8.0, "rollout/generated_tokens": 40.0}
    out = clock.finish(metrics, rollout)

    paused = (2.0 if colocate else 0.0) + (1.0 if full_weight_sync else 0.0)
    busy = min(4.0 - paused, max(0.0, 3.0 - paused))  # 3 active seconds since the clock started
    assert metrics["time/trainer_wait_s"] == 1.0 and metrics["time/step_s"] == 4.0
    assert out == {
        "perf/trainer_busy_frac": 3.0 / 4.0,
        "perf/trainer_wait_s": 1.0,
        "perf/engine_busy_frac": busy / 4.0,
        "perf/engine_paused_s": paused,
        "perf/engine_idle_frac": (4.0 - busy - paused) / 4.0,
        "rollout/step_generated_tokens_per_s": 10.0,
    }
    # the next step counts from these counters
    clock_time.now += 2.0
    metrics = {**clock.waited(), "time/sync_s": 0.0}
    metrics.update(clock.end(metrics))
    out = clock.finish(metrics, {"engines/active_s": 9.0, "rollout/generated_tokens": 50.0})
    assert out["rollout/step_generated_tokens_per_s"] == 5.0 and out["perf/engine_busy_frac"] == 0.5


def test_speculative_rates_are_the_steps_own():
    """Each step's rates come from the counters' growth over the step (SGLang's meta info fields,
    summed by the engine pool), not from the run so far; no verify in a step: no rates."""
    clock = StepClock(0.0, colocate=False, full_weight_sync=True)

    def counters(verify, proposed, correct, tokens):
        return {
            "rollout/spec_verify_ct": verify,
            "rollout/spec_num_proposed_drafts": proposed,
            "rollout/spec_num_correct_drafts": correct,
            "rollout/spec_verified_tokens": tokens,
        }

    assert clock.speculation(counters(10, 20, 15, 25)) == {
        "rollout/spec_accept_rate": 0.75,
        "rollout/spec_tokens_per_forward": 2.5,
    }
    assert clock.speculation(counters(14, 28, 16, 30)) == {  # this step: 4 verifies, 8 drafts, 1 kept
        "rollout/spec_accept_rate": 0.125,
        "rollout/spec_tokens_per_forward": 1.25,
    }
    assert clock.speculation(counters(14, 28, 16, 30)) == {}
    assert StepClock(0.0, colocate=False, full_weight_sync=True).speculation({}) == {}
