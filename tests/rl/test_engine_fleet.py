"""Elastic engines in a real RL run: Ray, Megatron ranks (EP2, gloo), embedded engines, real weight
syncs, and `moe-rl engines` talking to the driver through RUN_DIR/control from another thread
(as from another node: only files are shared).

During a fully-async run: `engines add RUN_DIR 1` starts engine-2 (the count rises; it is caught
up to the committed version and only then gets work: every token it generates carries a version
it held), then `engines remove RUN_DIR engine-1` while engine-1 holds requests (held there by an
in-place pause, so they are surely cut): they continue on the other engines, the sender forgets
it, its process is gone. The run finishes every step and every started group is trained once or
dropped once with a reason.

The driver parks (its `recover` polling goes on) only where the run would otherwise race past the
scenario: until the add answered, until the checks after it are done, and at the next steps' batch
(while their round generates) until engine-1 held requests and was removed. From the checks on,
engine-1 is paused in place at every admit, before the admitted round starts, so the requests it
is sent stay there however fast the machine generates.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import threading
import time

import psutil
import pytest
import ray

from moe_rl.cli import main
from moe_rl.rl.cluster import RLCluster
from tests.rl.cluster_runs import on_engine, run_with_cluster
from tests.rl.test_rl_modes import check_ledger

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
STEPS, GROUPS, ADD_AT = 8, 4, 2  # the add is asked for once ADD_AT steps are done
NEW, REMOVED = 2, 1  # engine-2 joins, engine-1 leaves
LIMIT_S = 120  # a scenario step that has not happened by then fails the test
# groups generating or being scored in the rollout worker (`RolloutManager.accounting`); a lambda,
# so Ray sends it by value (the worker cannot import this test module)
open_groups = lambda worker: worker.manager.accounting()["open"]  # noqa: E731


class FleetCluster(RLCluster):
    """An `RLCluster` whose engines are changed by `moe-rl engines` commands from a thread."""

    def __init__(self, *args, **kwargs):
        self.steps = 0
        self.added, self.checked, self.removed = threading.Event(), threading.Event(), threading.Event()
        self.parks, self.released = 0, 0  # the driver's parks for the removal, and those the thread let go
        self.failure: list[str] = []
        self.seen: dict = {"retries": 0}
        super().__init__(*args, **kwargs)
        self.commands = threading.Thread(target=self.run_commands, daemon=True)
        self.commands.start()

    def get_batch(self, asked):
        if self.steps == ADD_AT:
            self.park_until(self.added.is_set)
        if self.steps == ADD_AT + 1:  # the run must not race past the scenario's checks
            self.park_until(self.checked.is_set)
        if self.steps >= ADD_AT + 2 and not self.removed.is_set():
            # the round admitted by the last sync is generating now: the thread holds engine-1's
            # requests there and removes it, or lets the driver go on when none came (next step)
            self.parks += 1
            self.park_until(lambda: self.removed.is_set() or self.released == self.parks)
        self.steps += 1
        return super().get_batch(asked)

    def admit(self, version: int) -> ray.ObjectRef:
        if self.checked.is_set() and not self.removed.is_set():
            # the sync just resumed every engine; engine-1 holds what the admitted round sends it
            # (in place: queued, not stepped) until it is removed, while the driver parks
            asyncio.run(on_engine(self.url_of(REMOVED), lambda client: client.pause_generation("in_place")))
        return super().admit(version)

    def park_until(self, done) -> None:
        """The driver waits for a command while serving the control channel (`recover`)."""
        while not done():
            assert not self.failure, self.failure
            self.recover()
            time.sleep(0.05)

    def run_commands(self) -> None:
        try:
            self._run_commands()
        except BaseException as error:  # noqa: BLE001 - the driver fails the test with it
            self.failure.append(repr(error))
            self.added.set()
            self.checked.set()
            self.removed.set()

    def _run_commands(self) -> None:
        run_dir = str(self.run_dir)
        while self.steps < ADD_AT:  # the driver parks there until the add is answered
            time.sleep(0.05)
        start = time.perf_counter()
        self.seen["live_before"] = sum(s["live"] for s in self.engine_states())
        self.seen["add"] = _command(["engines", "add", run_dir, "1"])
        self.seen["add_wall_s"] = time.perf_counter() - start
        self.seen["add_version"] = self.version
        self.seen["live_after_add"] = sum(s["live"] for s in self.engine_states())
        self.added.set()
        while self.engine_states()[NEW]["served"] < 2:  # the new engine serves requests
            _before(start + LIMIT_S, "engine-2 served no requests")
            time.sleep(0.01)
        self.seen["new_serves_s"] = time.perf_counter() - start
        self.seen["list"] = _command(["engines", "list", run_dir])
        # refused by the driver, naming the field and the fix
        self.seen["too_many"] = _command(["engines", "add", run_dir, "64"])
        self.seen["unknown"] = _command(["engines", "remove", run_dir, "engine-9"])
        self.checked.set()
        self.hold_requests()
        self.seen["held"] = self.engine_states()[REMOVED]["in_flight"]
        self.seen["pid"] = ray.get(self.servers[REMOVED].pid.remote())
        self.seen["remove"] = _command(["engines", "remove", run_dir, f"engine-{REMOVED}"])
        self.seen["states_after_remove"] = self.engine_states()
        self.removed.set()

    def hold_requests(self) -> None:
        """Once the driver parked for the removal, wait for engine-1 (paused at the admit) to hold a
        request; when the parked step's groups all ended elsewhere, let the driver go on."""
        deadline = time.perf_counter() + LIMIT_S
        while True:
            while self.parks == self.released:
                _before(deadline, "the driver did not park for the removal")
                time.sleep(0.005)
            if self.engine_states()[REMOVED]["in_flight"] >= 1:
                return
            if not ray.get(self.rollout.__ray_call__.remote(open_groups)):
                self.seen["retries"] += 1  # nothing generating until the next admit
                self.released = self.parks
            time.sleep(0.002)

    def close(self):
        self.seen["final_states"] = self.engine_states()
        self.seen["final_servers"] = sorted(self.servers)
        return super().close()


def _before(deadline: float, what: str) -> None:
    """A scenario step that cannot happen fails the test instead of hanging it."""
    assert time.perf_counter() < deadline, f"{what} within {LIMIT_S} s"


def _command(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(argv)
    return code, out.getvalue()


def test_engines_added_and_removed_mid_run(tmp_path, monkeypatch):
    summary, cluster, rows = run_with_cluster(FleetCluster, tmp_path, monkeypatch, STEPS, engines=2)
    seen = cluster.seen
    assert not cluster.failure, cluster.failure
    print({k: v for k, v in seen.items() if k not in ("final_states", "states_after_remove")})

    # the run finished every step; every started group trained exactly once, or dropped once with a reason
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    check_ledger(summary, GROUPS, STEPS)

    # add: the engine count rose; engine-2 joined at the committed version and served only versions it held
    code, out = seen["add"]
    assert code == 0 and "engine-2 serves version" in out, out
    assert (seen["live_before"], seen["live_after_add"]) == (2, 3)
    assert max(r["engines/live"] for r in rows) == 3
    new = seen["final_states"][NEW]
    assert new["live"] and new["served"] >= 2
    low, high = new["versions"]
    assert ADD_AT <= seen["add_version"] <= low <= high <= STEPS  # never a token from its launch weights
    assert "engine-2" in seen["list"][1] and seen["list"][0] == 0
    code, out = seen["too_many"]
    assert code == 2 and "N: 64 engines need 64 CPUs" in out and "add a node" in out, out
    code, out = seen["unknown"]
    assert code == 2 and "NAME: engine-9 is not an engine of this run (engines: engine-0, engine-1, engine-2)" in out

    # remove: engine-1's held requests were cut and continued elsewhere; its process is gone
    code, out = seen["remove"]
    assert code == 0 and f"engine-{REMOVED} removed" in out, out
    assert f"requests it ran, continued elsewhere: {seen['held']}" in out
    assert seen["held"] >= 1 and rows[-1]["engines/cut_requests"] >= seen["held"]
    assert seen["states_after_remove"][REMOVED]["removed"]
    assert not psutil.pid_exists(seen["pid"]) or psutil.Process(seen["pid"]).status() == psutil.STATUS_ZOMBIE
    assert seen["final_servers"] == [0, NEW]
    assert rows[-1]["engines/live"] == 2
    assert (rows[-1]["engines/added"], rows[-1]["engines/removed"]) == (1, 1)
    # no restart was needed on the way
    assert rows[-1]["engines/restarts"] == 0
    # the new engine got the committed version from a live engine, not from the trainer
    assert (rows[-1]["engines/joins_from_peer"], rows[-1]["engines/joins_from_trainer"]) == (1, 0)
    # per step: live engines, seconds, generated tokens/s (shared cores, parked steps: recorded, not asserted)
    for r in rows:
        tokens_per_s = r["rollout/step_generated_tokens_per_s"]
        print(f"step {r['step']}: {r['engines/live']} engines, {r['time/step_s']:.2f} s, {tokens_per_s:.0f} tokens/s")
