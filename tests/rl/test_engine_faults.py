"""Engine faults in a real RL run: Ray, Megatron ranks (EP2, gloo), two embedded engines, real
weight syncs. FAULT INJECTION (named as such): the driver's cluster SIGKILLs engine-1 just as the
sync to version 2 starts (engine-0 commits it), then engine-0 while it has requests in flight and
engine-1 is still restarting (so for a while no engine is live and requests wait).

Proves: the run finishes every step; every started group is trained exactly once or dropped once
with a reason; the lost requests were resubmitted; each engine was restarted once, serves the
committed weight version (its /model_info) and got work again after its restart, fed by the other
engine (`moe_rl.rl.joins`), not by the trainer.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import aiohttp
import pytest
import ray

from moe_rl.rl.cluster import RLCluster
from tests.rl.cluster_runs import on_engine, run_with_cluster
from tests.rl.test_rl_modes import check_ledger

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
STEPS, GROUPS, SYNC_KILL_AT = 8, 4, 2


class FaultyCluster(RLCluster):
    """FAULT INJECTION: an `RLCluster` that kills engine processes at chosen moments and records
    what recovery did."""

    def __init__(self, *args, **kwargs):
        self.events: list[tuple] = []
        self.final: dict = {}
        super().__init__(*args, **kwargs)
        self.stopped = threading.Event()
        self.quiet = threading.Lock()  # held by a sync, so none aborts the requests the watcher holds
        self.watcher = threading.Thread(target=self.watch, daemon=True)
        self.watcher.start()

    def kill(self, index: int, why: str) -> None:
        os.kill(ray.get(self.engines[index].pid.remote()), signal.SIGKILL)
        self.events.append((why, index, self.version))

    def sync(self, version: int) -> dict[str, float]:
        if version == SYNC_KILL_AT:
            self.kill(1, "killed_in_sync")
        with self.quiet:
            metrics = super().sync(version)
        if version == SYNC_KILL_AT:  # the live engine committed in that same sync
            self.events.append(("engine-0 serves", asyncio.run(_served_version(self.url(0)))))
        return metrics

    def get_batch(self, n_groups: int) -> list:
        # A real step takes minutes and outlasts a restart; here steps take 0.3 s and a restart
        # ~10 s on two busy cores: let each restart finish before the next step asks for a batch.
        self.wait_for_restarts()
        return super().get_batch(n_groups)

    def watch(self) -> None:
        """Thread: once engine-1 is back (restarted, caught up), kill engine-0 as soon as it has
        requests in flight; engine-1, the only live engine then, must redo them."""
        while not self.stopped.is_set():
            if ("revived", 1) in [e[:2] for e in self.events]:
                if ray.get(self.rollout.engine_states.remote())[0]["in_flight"] >= 1:
                    with self.quiet:  # no sync aborts them between the pause and the kill
                        # hold them there (an in-place pause keeps requests in the engine), so they
                        # are still in flight when the process dies, not finished in between; the
                        # engine's own count, as the pool's may include an answer on its way back
                        url = self.url(0)
                        asyncio.run(on_engine(url, lambda client: client.pause_generation("in_place")))
                        if asyncio.run(_held_requests(url)) >= 1:
                            self.kill(0, "killed_in_rollout")
                            return
                        asyncio.run(on_engine(url, lambda client: client.continue_generation()))
            time.sleep(0.002)

    def recover(self) -> None:
        before = set(self.restarting)
        super().recover()
        for index in before - set(self.restarting):
            self.events.append(("revived", index, self.version))

    def url(self, index: int) -> str:
        return ray.get(self.engines[index].url.remote())

    def wait_for_restarts(self) -> None:
        deadline = time.monotonic() + 120
        while self.restarting or not all(s["live"] for s in ray.get(self.rollout.engine_states.remote())):
            assert time.monotonic() < deadline, "an engine was not back within 120 s"
            self.recover()
            time.sleep(0.2)

    def close(self):
        self.wait_for_restarts()  # then look at every engine before tearing down
        self.stopped.set()
        self.watcher.join()
        self.final = {
            "states": ray.get(self.rollout.engine_states.remote()),
            "version": self.version,
            "versions": [asyncio.run(_served_version(self.url(i))) for i in range(len(self.engines))],
        }
        return super().close()


async def _held_requests(url: str) -> int:
    """The requests the engine at `url` holds, running or waiting (its SGLang `/get_load`)."""
    async with aiohttp.ClientSession() as session, session.get(f"{url}/get_load") as response:
        (load,) = await response.json()
    return load["num_running_reqs"] + load["num_waiting_reqs"]


async def _served_version(url: str) -> str:
    return (await on_engine(url, lambda client: client.model_info()))["weight_version"]


def test_engine_killed_in_rollout_and_in_sync(tmp_path, monkeypatch):
    summary, cluster, rows = run_with_cluster(FaultyCluster, tmp_path, monkeypatch, STEPS, engines=2)
    print(cluster.events, cluster.final, [r["time/step_s"] for r in rows])

    # the trainer was not disturbed: every step ran
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    # every started group trained exactly once, or dropped once with a reason
    check_ledger(summary, GROUPS, STEPS)
    # engine-1 died as sync 2 started: dropped, engine-0 committed version 2 in that same sync
    events = cluster.events
    assert events[0] == ("killed_in_sync", 1, SYNC_KILL_AT - 1) and events[1] == ("engine-0 serves", "2")
    assert rows[SYNC_KILL_AT - 1]["engines/restarts"] == 1
    # engine-1 came back; then engine-0 died in rollout and came back too
    order = [e[:2] for e in events if e[0] != "engine-0 serves"]
    assert order == [("killed_in_sync", 1), ("revived", 1), ("killed_in_rollout", 0), ("revived", 0)], events
    assert cluster.restarts == 2
    # the requests lost with engine-0 were resubmitted (counted)
    assert rows[-1]["engines/resubmitted_requests"] >= 1
    # restarted engines serve the committed version; engine-1 got work again (engine-0's requests)
    final = cluster.final
    assert final["versions"] == [str(STEPS)] * 2 and final["version"] == STEPS
    assert all(state["live"] for state in final["states"])
    assert final["states"][1]["served"] > 0
    # each restarted engine got the committed version from the other, live one: the trainer sent
    # the joiners nothing (its stall for them is 0), and the next sync took them in
    assert rows[-1]["engines/joins_from_peer"] == 2 and rows[-1]["engines/joins_from_trainer"] == 0
    assert sum(r["engines/join_trainer_seconds"] for r in rows) == 0
    assert sum(r["engines/join_bytes"] for r in rows) > 0
