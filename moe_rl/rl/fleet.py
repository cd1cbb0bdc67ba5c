"""Elastic engines: the driver adds and removes rollout engines while training goes on.

`EngineFleet` is the driver's side of `moe-rl engines` (the requests arrive through
`moe_rl.rl.control`); `RLCluster.recover` calls `poll` while the driver waits for a batch and after
each weight sync, so the trainer never stops for it.

Add N, as numbered steps (the same catch-up a restarted engine takes, `moe_rl.rl.cluster`):
  1. refuse what cannot be placed: colocated engines (they live on the trainer's GPUs), pinned
     cores (`cpu_pools` names one core list per starting engine), a Ray cluster without the free
     CPUs/GPUs `engine_placement` asks for (add a node first);
  2. start N `EngineServer` actors at the next indices (`engine-{n}`, never reused), placed as
     `engine_placement` places engines, on the run's starting checkpoint (serving its version);
     the driver goes on while they load;
  3. once one is healthy, it gets the committed version (`moe_rl.rl.joins`): from a live engine
     (the trainer keeps stepping), or from the trainer's sender (`SyncRequest.joined`: a
     weight-update group of the new engines only; the others keep generating);
  4. only then does the rollout pool give it work (`EnginePool.add`), so it never serves a version
     other than the one every engine holds; `engines/added` counts it.
  An engine that fails to start or dies while catching up is stopped and named in the answer.

Remove NAME:
  1. refuse colocated engines, an unknown name, an engine that is not live (restarting, or still
     starting), and the last live engine;
  2. the pool gives it no new work and aborts what it runs until nothing is left
     (`EnginePool.remove`); each cut request returns with its tokens and the rollout continues
     it on another engine as a partial rollout (`rollout.partial_rollout: false`: it restarts,
     its tokens counted `rollout/discarded_tokens`), so no group is lost;
  3. the sender forgets it (`SyncRequest.lost`: the next update re-forms the group without it);
  4. its actor stops its process and is killed; `engines/removed` counts it.
The fleet's size is not part of a run checkpoint: `--resume` starts `engines.count` engines.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass, field

import ray

from moe_rl.engine.client import engine_index, engine_name
from moe_rl.rl.control import POLL_S, ControlChannel, FleetAnswer, FleetRequest
from moe_rl.rl.rollout_actor import engine_placement
from moe_rl.trainer.weight_sync import SyncRequest


class Refused(ValueError):
    """A request the fleet cannot carry out (the message names the field and the fix)."""


@dataclass
class Adding:
    """An add under way: its engines still starting (index -> (actor, ref to its URL))."""

    request: FleetRequest
    starting: dict[int, tuple[ray.actor.ActorHandle, ray.ObjectRef]]
    began: float = field(default_factory=time.perf_counter)
    joining: set[int] = field(default_factory=set)  # up, getting the committed version (`moe_rl.rl.joins`)
    joined: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


class EngineFleet:
    """`cluster`: the run's `moe_rl.rl.cluster.RLCluster` (not imported here: it builds this fleet)."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.channel = ControlChannel(cluster.run_dir)
        self.next_index = max(cluster.servers) + 1
        self.adding: list[Adding] = []
        self._next_read = 0.0
        self.channel.open()

    def poll(self) -> None:
        """Advance adds under way; read new requests (at most every `control.POLL_S`) and act."""
        self._admit_started()
        if time.monotonic() < self._next_read:
            return
        self._next_read = time.monotonic() + POLL_S
        for request in self.channel.take():
            if isinstance(request, tuple):  # malformed: (id, error)
                self.channel.answer(FleetAnswer(request[0], "failed", str(request[1])))
                continue
            try:
                self._act(request)
            except Refused as error:
                self.channel.answer(self._answer(request, "failed", str(error)))

    def _act(self, request: FleetRequest) -> None:
        if request.action == "list":
            self.channel.answer(self._answer(request, "done", f"{len(self.cluster.servers)} engines"))
        elif request.action == "add":
            self._start(request)
        else:
            self._remove(request)

    # -- add ------------------------------------------------------------------------------------

    def _start(self, request: FleetRequest) -> None:
        """Add, steps 1 and 2."""
        cfg = self.cluster.config
        if cfg.rl.colocate:
            raise Refused("rl.colocate: colocated engines live on the trainer's GPUs; their number is fixed")
        if cfg.cpu_pools is not None:
            raise Refused(
                "cpu_pools: the run pins each engine to the cores named in cpu_pools.engines, and a new "
                "engine has none; run without cpu_pools to add engines"
            )
        placement = engine_placement(dataclasses.replace(cfg.engines, count=request.count), colocate=False)
        need_cpus = sum(options["num_cpus"] for options, _ in placement)
        need_gpus = sum(options["num_gpus"] for options, _ in placement)
        free = ray.available_resources()
        if free.get("CPU", 0) < need_cpus or free.get("GPU", 0) < need_gpus:
            raise Refused(
                f"N: {request.count} engines need {need_cpus} CPUs and {need_gpus} GPUs, the Ray cluster has "
                f"{free.get('CPU', 0):g} CPUs and {free.get('GPU', 0):g} GPUs free: add a node to it "
                "(`ray start --address=<head>` there), or add fewer engines"
            )
        starting = {}
        for options, _ in placement:
            index, self.next_index = self.next_index, self.next_index + 1
            server = self.cluster.start_engine(index, options)
            starting[index] = (server, server.url.remote())
        self.adding.append(Adding(request, starting))
        names = ", ".join(engine_name(index) for index in starting)
        self.channel.answer(self._answer(request, "accepted", f"starting {names}"))

    def _admit_started(self) -> None:
        """Add, steps 3 and 4, for the engines that came up since the last poll."""
        for adding in list(self.adding):
            ready = {}
            for index, (server, url) in list(adding.starting.items()):
                if not ray.wait([url], timeout=0)[0]:
                    continue
                del adding.starting[index]
                try:
                    ready[index] = (server, ray.get(url))
                except ray.exceptions.RayError as error:
                    self._discard(server)
                    adding.failed.append(f"{engine_name(index)} did not start ({_summary(error)})")
            for index, (server, url) in ready.items():
                adding.joining.add(index)
                self.cluster.joins.start(index, url, done=functools.partial(self._joined, adding, index, server, url))
            if not adding.starting and not adding.joining:
                self.adding.remove(adding)
                self._answer_add(adding)

    def _joined(self, adding: Adding, index: int, server, url: str, serving: bool) -> None:
        """Add, step 4, for one engine: it serves the committed version (the pool gives it work), or
        it died while it received the weights."""
        adding.joining.discard(index)
        if serving:
            self.cluster.servers[index] = server
            ray.get(self.cluster.rollout.add_engine.remote(index, url))
            adding.joined.append(engine_name(index))
        else:
            self._discard(server)
            adding.failed.append(f"{engine_name(index)} died while it received the weights")

    def _answer_add(self, adding: Adding) -> None:
        seconds = time.perf_counter() - adding.began
        log = f"see {self.cluster.run_dir}/engine-N.log"
        if adding.failed:
            joined = f"; {_serve(adding.joined)}" if adding.joined else ""
            message = f"{'; '.join(adding.failed)} ({log}){joined}"
            answer = self._answer(adding.request, "failed", message, seconds)
        else:
            message = f"{_serve(adding.joined)} version {self.cluster.version} and get work"
            answer = self._answer(adding.request, "done", message, seconds)
        self.channel.answer(answer)

    def _discard(self, server) -> None:
        """Stop a new engine that will not join (its process, then its actor)."""
        try:
            ray.get(server.stop.remote())
        except ray.exceptions.RayError:
            pass  # its actor died with it
        ray.kill(server)

    # -- remove ---------------------------------------------------------------------------------

    def _remove(self, request: FleetRequest) -> None:
        """Remove, steps 1 to 4."""
        start, name, cluster = time.perf_counter(), request.name, self.cluster
        if cluster.config.rl.colocate:
            raise Refused("rl.colocate: colocated engines live on the trainer's GPUs; their number is fixed")
        index = engine_index(name)
        states = cluster.engine_states()
        if any(index in adding.starting for adding in self.adding):
            raise Refused(f"NAME: {name} is still starting: remove it once its add has answered")
        if index not in cluster.servers:
            names = ", ".join(engine_name(i) for i in sorted(cluster.servers))
            raise Refused(f"NAME: {name} is not an engine of this run (engines: {names})")
        if index in cluster.restarting or not states[index]["live"]:
            raise Refused(f"NAME: {name} is not live (restarting): remove it once it serves again")
        if not any(state["live"] for i, state in enumerate(states) if i != index):
            raise Refused(f"NAME: {name} is the last live engine: add one first (`moe-rl engines add RUN_DIR 1`)")
        server = cluster.servers[index]
        pid = ray.get(server.pid.remote())
        cut = ray.get(cluster.rollout.remove_engine.remote(index))
        cluster.trainer.sync_weights(SyncRequest(cluster.version, cluster.config.sync.bucket_bytes, lost=(name,)))
        del cluster.servers[index]
        self._discard(server)
        message = f"{name} removed (its process, pid {pid}, stopped); requests it ran, continued elsewhere: {cut}"
        self.channel.answer(self._answer(request, "done", message, time.perf_counter() - start))

    # -- answers --------------------------------------------------------------------------------

    def _answer(self, request: FleetRequest, state: str, message: str, seconds: float | None = None) -> FleetAnswer:
        return FleetAnswer(request.id, state, message, self.engines(), self.cluster.version, seconds)

    def engines(self) -> list[dict]:
        """Every engine of the run now: name, state (starting, live, restarting, dead), requests in
        flight and served, and the (lowest, highest) token version it generated since it got work."""
        states = self.cluster.engine_states()
        rows = []
        for index in sorted(self.cluster.servers):
            state = states[index]
            status = "live" if state["live"] else "restarting" if index in self.cluster.restarting else "dead"
            rows.append(
                {
                    "name": engine_name(index),
                    "state": status,
                    "in_flight": state["in_flight"],
                    "served": state["served"],
                    "versions": state["versions"],
                }
            )
        starting = sorted(index for adding in self.adding for index in adding.starting)
        rows += [{"name": engine_name(i), "state": "starting"} for i in starting]
        return rows

    def close(self) -> None:
        """The run ends: engines still starting are stopped, and every request not done is
        answered (the rollout worker may be gone: the answers carry no fleet)."""
        self.channel.close()  # first: a command started from now on is told at once
        ended = "the run ended before the request was done"
        for adding in self.adding:
            for server, _ in adding.starting.values():
                self._discard(server)
            self.channel.answer(FleetAnswer(adding.request.id, "failed", f"{ended} (its engines were starting)"))
        self.adding = []
        for request in self.channel.take():
            self.channel.answer(FleetAnswer(request[0] if isinstance(request, tuple) else request.id, "failed", ended))


def _serve(names: list[str]) -> str:
    return f"{', '.join(names)} {'serves' if len(names) == 1 else 'serve'}"


def _summary(error: BaseException) -> str:
    """The last line of a Ray error (the remote exception's message)."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__
