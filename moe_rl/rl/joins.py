"""How a restarted or added engine gets the committed version before it gets work.

`Joins` is the driver's side (`moe_rl.rl.cluster.RLCluster` owns one). An engine that joins serves
the run's starting checkpoint; it must hold the committed version before the rollout pool gives
it work. Two sources (`engines.join_from`):
- "peer" (embedded engines, full-weight sync): a live engine sends the version it serves to the
  joiner over a group of their own and commits it there (`sync.peer_feed`, the engine's
  `/feed_peers`), on a thread of the driver; the trainer keeps stepping and resends nothing;
- "trainer": the trainer's sender exports the version again and sends it to the joiners only
  (`RLCluster.catch_up`; SGLang, LoRA, or when no peer can feed).
A peer join, as numbered steps (`start`, then `poll` from the driver's `recover`):
  1. pick the live engine with the fewest requests in flight (none live: the trainer feeds it);
  2. the feed runs on a driver thread while the driver goes on;
  3. once it returns: if the joiner committed the version the trainer last committed, it is
     queued for the trainer's sender (`pending`: taken into the next `SyncRequest.joined` as
     serving that version, so the next update re-forms the group with it and a delta applies on
     what it holds) and `done(True)` gives it work; if the trainer committed a newer version
     meanwhile, it is fed again; if the feed failed (the peer or the joiner died), the trainer
     feeds it (`catch_up`), and `done(False)` if it died.
Metrics (`metrics`, taken once per step): `engines/join_seconds` (the last join: joiner up ->
serving the committed version), `engines/join_bytes` (bytes fed by peers since the last step),
`engines/join_trainer_seconds` (the driver's seconds in trainer catch-ups since the last step: the
trainer's stall for joiners), `engines/joins_from_peer` and `engines/joins_from_trainer` (counts).
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from moe_rl.engine.client import EngineClient, engine_name

log = logging.getLogger(__name__)


@dataclass
class Join:
    index: int
    url: str
    done: Callable[[bool], None]
    """Called once: True when the engine serves the committed version, False if it died."""
    began: float = field(default_factory=time.perf_counter)
    feed: Future | None = None


class Joins:
    """`cluster`: the run's `RLCluster` (not imported here: it builds this)."""

    def __init__(self, cluster, from_peer: bool):
        self.cluster, self.from_peer = cluster, from_peer
        self.active: dict[int, Join] = {}
        self.pending: dict[str, str] = {}  # fed by a peer, for the next SyncRequest.joined
        self._threads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="peer-feed")
        self._bytes, self._seconds, self.peer_joins, self.trainer_joins = 0, None, 0, 0
        self._trainer_seconds = 0.0

    def start(self, index: int, url: str, done: Callable[[bool], None]) -> None:
        """Engine `index` is up at `url` (serving the starting checkpoint): bring it to the committed version."""
        join = Join(index, url, done)
        fresh = self.cluster.version == self.cluster.initial_version  # it serves that already
        if fresh or not self.from_peer or not self._feed(join):
            self._from_trainer(join)
            return
        self.active[index] = join

    def poll(self) -> None:
        """Advance the peer feeds that finished (step 3)."""
        for index, join in list(self.active.items()):
            if not join.feed.done():
                continue
            del self.active[index]
            try:
                result = join.feed.result()
            except Exception as error:  # noqa: BLE001 - the peer or the joiner died: the trainer feeds it
                log.warning("feeding %s from a peer failed (%s); the trainer sends it the weights", index, error)
                self._from_trainer(join)
                continue
            self._bytes += result["bytes"]
            if result["version"] != self.cluster.version:  # the trainer moved on meanwhile: again
                if self._feed(join):
                    self.active[index] = join
                else:
                    self._from_trainer(join)
                continue
            self.pending[engine_name(index)] = join.url
            self.peer_joins += 1
            self._admitted(join)

    def forget(self, index: int) -> bool:
        """Engine `index` died before the trainer's sender took it in: True if it was only known here."""
        self.active.pop(index, None)
        return self.pending.pop(engine_name(index), None) is not None

    def take_pending(self) -> dict[str, str]:
        pending, self.pending = self.pending, {}
        return pending

    def metrics(self) -> dict[str, float]:
        out = {
            "engines/joins_from_peer": float(self.peer_joins),
            "engines/joins_from_trainer": float(self.trainer_joins),
        }
        if self._seconds is not None:
            out["engines/join_seconds"] = self._seconds
        out["engines/join_bytes"], self._bytes = float(self._bytes), 0
        out["engines/join_trainer_seconds"], self._trainer_seconds = self._trainer_seconds, 0.0
        return out

    def close(self) -> None:
        self._threads.shutdown(wait=True, cancel_futures=True)

    def _feed(self, join: Join) -> bool:
        """Step 1-2: start a feed from the least busy live engine; False if none can feed."""
        states = self.cluster.engine_states()
        peers = [
            i
            for i, state in enumerate(states)
            if state["live"] and not state["removed"] and i != join.index and i not in self.active
        ]
        if not peers:
            return False
        peer = min(peers, key=lambda i: states[i]["in_flight"])
        peer_url = self.cluster.url_of(peer)
        sync = self.cluster.config.sync
        request = ({engine_name(join.index): join.url}, sync.bucket_bytes, sync.timeout_s, sync.backend)
        join.feed = self._threads.submit(_feed, peer_url, engine_name(peer), request)
        return True

    def _from_trainer(self, join: Join) -> None:
        start = time.perf_counter()
        dropped = self.cluster.catch_up({engine_name(join.index): join.url})
        self._trainer_seconds += time.perf_counter() - start
        self.trainer_joins += 1
        if engine_name(join.index) in dropped:
            join.done(False)
        else:
            self._admitted(join)

    def _admitted(self, join: Join) -> None:
        self._seconds = time.perf_counter() - join.began
        join.done(True)


def _feed(peer_url: str, peer_name: str, request: tuple) -> dict:
    async def go() -> dict:
        client = EngineClient(peer_url, kind="embedded", name=peer_name, retries=0)
        try:
            return await client.feed_peers(*request)
        finally:
            await client.close()

    return asyncio.run(go())
