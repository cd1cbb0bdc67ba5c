"""The step timeline: spans that every process of a run records on one clock, merged into one
Chrome/Perfetto trace, `RUN_DIR/trace.json` (open it in https://ui.perfetto.dev or chrome://tracing;
`moe-rl report` draws `plots/timeline.png` from it). docs/rl.md says how to read it.

Each process has one `Tracer`, `TRACER`, named once by whoever owns the process (`TRACER.process =
"trainer rank 0"`). It records only while on: the driver turns every process's tracer on for the
`rl.trace_steps` steps after the first and collects them at the end of the last (`RLCluster.start_trace`, `stop_trace`);
off, `add` costs one attribute check and `span` a context manager around it. Two kinds of span:
- `span(name)` / `add(name, start, end)`: a complete event on a lane, by default the calling thread
  (work that one thread does in turn: a forward, a batch build, the driver's loop);
- `add(..., group=key)`: an async event (Chrome's "b"/"e" pair with an id), for work that overlaps on
  one thread, such as a group's generation on the rollout worker's event loop.
The clock is wall time (`time.time()`): one clock for every process on a node; across nodes as
close as their NTP sync. Recording a span appends one tuple (about a microsecond).
"""

from __future__ import annotations

import gc
import json
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

TRACE_FILE = "trace.json"


class Tracer:
    """One process's span recorder (module docstring)."""

    def __init__(self, process: str = ""):
        self.process = process or f"pid {os.getpid()}"
        self.on = False
        self.started = 0.0  # when recording last started (`time.time()`)
        self._cpu_start = 0.0
        self._gc_start = 0.0
        self._events: list[tuple] = []
        self._lock = threading.Lock()

    def start(self) -> None:
        """Record from now on (what an earlier window recorded is dropped)."""
        with self._lock:
            self._events = []
        self._cpu_start = time.process_time()
        self.started, self.on = time.time(), True
        if self._collection not in gc.callbacks:
            gc.callbacks.append(self._collection)

    def stop(self) -> dict:
        """Stop recording; returns what was recorded: `{"process", "pid", "events", "cpu_s", "wall_s"}`,
        each event (name, start s, end s, lane, group key or None, args); `cpu_s`: the CPU seconds
        the process used meanwhile (every thread), against `wall_s` of wall time."""
        self.on = False
        if self._collection in gc.callbacks:
            gc.callbacks.remove(self._collection)
        with self._lock:
            events, self._events = self._events, []
        cpu, wall = time.process_time() - self._cpu_start, time.time() - self.started
        return {"process": self.process, "pid": os.getpid(), "events": events, "cpu_s": cpu, "wall_s": wall}

    @contextmanager
    def span(self, name: str, lane: str | None = None, **args) -> Iterator[None]:
        """Record the `with` body as span `name` (on `lane`, else the calling thread's)."""
        if not self.on:
            yield
            return
        start = time.time()
        try:
            yield
        finally:
            self.add(name, start, time.time(), lane, **args)

    def add(self, name: str, start: float, end: float, lane: str | None = None, group: str | None = None, **args):
        """A span measured by the caller (`time.time()` seconds); `group`: an async span of that key."""
        if not self.on:
            return
        lane = lane or threading.current_thread().name
        with self._lock:
            self._events.append((name, start, end, lane, group, args))

    def _collection(self, phase: str, info: dict) -> None:
        """gc.callbacks: each pass of the cyclic garbage collector as a span on lane "gc" (a pass
        holds the GIL, so every thread of the process stops for it)."""
        if phase == "start":
            self._gc_start = time.time()
        elif self.on:
            self.add(f"gc gen {info['generation']}", self._gc_start, time.time(), "gc", collected=info["collected"])


TRACER = Tracer()
"""This process's tracer."""


def chrome_trace(recorded: list[dict]) -> dict:
    """Chrome's trace format from each process's `Tracer.stop()`: one pid per process (in the
    order given, labelled with its CPU use over the window), one tid per lane, times in
    microseconds from the first event."""
    starts = [event[1] for proc in recorded for event in proc["events"]]
    origin = min(starts) if starts else 0.0
    events: list[dict] = []
    for pid, proc in enumerate(recorded, start=1):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": proc["process"]}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        if proc.get("wall_s"):
            share = f"CPU {proc['cpu_s'] / proc['wall_s']:.0%} of the window ({proc['cpu_s']:.2f} s)"
            events.append({"ph": "M", "name": "process_labels", "pid": pid, "tid": 0, "args": {"labels": share}})
        lanes: dict[str, int] = {}
        for name, start, end, lane, group, args in proc["events"]:
            if lane not in lanes:
                lanes[lane] = len(lanes) + 1
                meta = {"name": "thread_name", "pid": pid, "tid": lanes[lane], "args": {"name": lane}}
                events.append({"ph": "M", **meta})
            ts, dur = (start - origin) * 1e6, max(0.0, end - start) * 1e6
            base = {"name": name, "cat": proc["process"], "pid": pid, "tid": lanes[lane], "args": args}
            if group is None:
                events.append({**base, "ph": "X", "ts": ts, "dur": dur})
            else:  # async: a b/e pair with the group's id (Perfetto draws one track per id)
                events.append({**base, "ph": "b", "id": group, "ts": ts})
                events.append({**base, "ph": "e", "id": group, "ts": ts + dur, "args": {}})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"origin_unix_s": origin}}


def write_trace(path: Path, recorded: list[dict]) -> Path:
    """`chrome_trace(recorded)` written to `path` (staged, then renamed: a reader never sees half)."""
    staged = path.with_name(path.name + ".tmp")
    staged.write_text(json.dumps(chrome_trace(recorded)))
    staged.replace(path)
    return path


def read_trace(path: Path) -> list[dict]:
    """The complete and async spans of a trace file: dicts with process, lane, name, start and end
    in seconds from its origin (async pairs joined), in file order."""
    data = json.loads(Path(path).read_text())
    processes, lanes, opened, spans = {}, {}, {}, []
    for event in data["traceEvents"]:
        pid, tid, ph = event["pid"], event.get("tid", 0), event["ph"]
        if ph == "M" and event["name"] == "process_name":
            processes[pid] = event["args"]["name"]
        elif ph == "M" and event["name"] == "thread_name":
            lanes[pid, tid] = event["args"]["name"]
        elif ph == "X":
            spans.append(_span(processes, lanes, event, event["ts"], event["ts"] + event["dur"]))
        elif ph == "b":
            opened[pid, event["id"], event["name"]] = event
        elif ph == "e":
            begin = opened.pop((pid, event["id"], event["name"]))
            spans.append({**_span(processes, lanes, begin, begin["ts"], event["ts"]), "group": event["id"]})
    return spans


def process_labels(path: Path) -> dict[str, str]:
    """Each process's label in a trace file (its CPU use over the window), by process name."""
    events = json.loads(Path(path).read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    return {names[e["pid"]]: e["args"]["labels"] for e in events if e["ph"] == "M" and e["name"] == "process_labels"}


def _span(processes: dict, lanes: dict, event: dict, start_us: float, end_us: float) -> dict:
    pid, tid = event["pid"], event.get("tid", 0)
    return {
        "process": processes.get(pid, str(pid)),
        "lane": lanes.get((pid, tid), str(tid)),
        "name": event["name"],
        "start": start_us / 1e6,
        "end": end_us / 1e6,
        "args": event.get("args", {}),
    }
