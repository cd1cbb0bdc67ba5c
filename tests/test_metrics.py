"""`MetricsLogger`: a row lands in metrics.jsonl and, as one event, in TensorBoard, which reads
every scalar back under its tag and step."""

from __future__ import annotations

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

from moe_rl.metrics import MetricsLogger, read_metrics


def test_rows_reach_jsonl_and_tensorboard(tmp_path):
    logger = MetricsLogger(tmp_path)
    logger.log(1, {"rollout": {"reward_mean": 0.25}, "time/step_s": 0.5, "note": "not a number"})
    logger.log(2, {"rollout": {"reward_mean": 0.75}, "time/step_s": 0.4})
    logger.close()
    rows = read_metrics(tmp_path)
    assert [(r["step"], r["rollout/reward_mean"], r["time/step_s"]) for r in rows] == [(1, 0.25, 0.5), (2, 0.75, 0.4)]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["rollout/reward_mean", "time/step_s"]
    assert [(e.step, e.value) for e in events.Scalars("rollout/reward_mean")] == [(1, 0.25), (2, 0.75)]
    assert [e.value for e in events.Scalars("time/step_s")] == pytest.approx([0.5, 0.4])
    (path,) = (tmp_path / "tensorboard").iterdir()
    written = list(EventFileLoader(str(path)).Load())
    assert [e.step for e in written if e.HasField("summary")] == [1, 2]  # a record per row, not per scalar
