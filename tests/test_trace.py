"""`moe_rl.trace`: a tracer records only while on, on the calling thread's lane or a named one, and
each pass of the garbage collector on lane "gc";
Chrome's format round-trips through `write_trace` / `read_trace` (complete events, async pairs,
one pid per process, times from the first event)."""

from __future__ import annotations

import gc
import json
import threading

from moe_rl.trace import Tracer, process_labels, read_trace, write_trace


def test_spans_record_only_while_on(tmp_path):
    tracer = Tracer("driver")
    with tracer.span("before"):
        pass
    tracer.add("before too", 1.0, 2.0)
    tracer.start()
    with tracer.span("train", step=3):
        pass
    worker = threading.Thread(target=lambda: tracer.add("build", 10.0, 10.5), name="batch build")
    worker.start()
    worker.join()
    tracer.add("generate", 10.2, 10.9, lane="groups", group="g1")
    recorded = tracer.stop()
    with tracer.span("after"):
        pass
    assert recorded["process"] == "driver" and recorded["cpu_s"] >= 0 and recorded["wall_s"] >= 0
    assert [(e[0], e[3], e[4], e[5]) for e in recorded["events"] if e[3] != "gc"] == [
        ("train", "MainThread", None, {"step": 3}),
        ("build", "batch build", None, {}),
        ("generate", "groups", "g1", {}),
    ]
    assert tracer.stop()["events"] == []  # nothing after stop


def test_collector_passes_on_their_own_lane():
    tracer = Tracer("rollout worker")
    gc.collect()
    assert tracer._collection not in gc.callbacks  # off: nothing installed
    tracer.start()
    gc.collect(1)
    recorded = tracer.stop()
    passes = [e for e in recorded["events"] if e[3] == "gc"]
    assert [e[0] for e in passes][-1] == "gc gen 1" and passes[-1][1] <= passes[-1][2]
    assert "collected" in passes[-1][5]
    assert tracer._collection not in gc.callbacks
    gc.collect()
    assert tracer.stop()["events"] == []


def test_chrome_trace_round_trip(tmp_path):
    recorded = [
        {
            "process": "driver",
            "pid": 11,
            "events": [("step 2", 100.0, 100.5, "steps", None, {})],
            "cpu_s": 0.25,
            "wall_s": 1.0,
        },
        {
            "process": "engine-0",
            "pid": 12,
            "events": [
                ("decode", 100.1, 100.2, "scheduler", None, {"rows": 4}),
                ("generate", 100.05, 100.4, "groups", "g7", {}),
            ],
        },
    ]
    path = write_trace(tmp_path / "trace.json", recorded)
    data = json.loads(path.read_text())
    names = {e["args"]["name"] for e in data["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"driver", "engine-0"}
    assert {e["pid"] for e in data["traceEvents"]} == {1, 2}
    spans = read_trace(path)
    assert [(s["process"], s["lane"], s["name"]) for s in spans] == [
        ("driver", "steps", "step 2"),
        ("engine-0", "scheduler", "decode"),
        ("engine-0", "groups", "generate"),
    ]
    by_name = {s["name"]: s for s in spans}
    assert by_name["step 2"]["start"] == 0.0 and abs(by_name["step 2"]["end"] - 0.5) < 1e-9
    assert abs(by_name["decode"]["start"] - 0.1) < 1e-9 and by_name["decode"]["args"] == {"rows": 4}
    assert process_labels(path) == {"driver": "CPU 25% of the window (0.25 s)"}  # engine-0 reported none
    assert by_name["generate"]["group"] == "g7" and abs(by_name["generate"]["end"] - 0.4) < 1e-9
