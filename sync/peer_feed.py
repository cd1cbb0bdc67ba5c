"""A live engine feeds the version it serves to engines that join, so the trainer resends nothing.

An engine that restarted, or one the fleet adds, starts on the run's starting checkpoint and must
hold the committed version before it gets work. Without this, the trainer's sender exports the
version again and sends it to the joiners (`sync.sender`: a catch-up): every trainer rank stops
for that export. Here a live engine that keeps the bytes it was sent (`WeightReceiver.applied`: the
embedded engine, the receiver-only engine) is the source instead, as numbered steps:
  1. `snapshot`: under the receiver's lock, the served version and a host copy of its tensors
     (the receiver reuses its storage two versions later, and the trainer may commit a new
     version while the feed runs: the copy keeps the feed one version);
  2. a `WeightSender` on the feeding engine, with the joiners as its engines, over a group of its
     own (`FEED_GROUP`: the feeder is rank 0, each joiner's TP ranks after it), sends that copy as
     a full version and commits it on every joiner: the same buckets, checksums and commit rule
     as a sync from the trainer, so a joiner never serves part of a version;
  3. the group is destroyed; the feeder never paused and kept generating.
The orchestrator then tells the trainer's sender that the joiners serve that version
(`WeightSender.add(engine, version)`): if it is still the committed one they are members like the
others (the next update re-forms the group with them, and a delta applies on what they hold);
if the trainer committed a newer one meanwhile, they are fed again.

Memory on the feeder: one host copy of the served version while the feed runs.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from sync.config import DeltaConfig, SyncConfig
from sync.engine_api import EngineEndpoint
from sync.receiver import WeightReceiver
from sync.sender import WeightSender

FEED_GROUP = "peer_feed_group"


@dataclass
class FeedResult:
    version: int
    """The version the joiners committed."""
    bytes: int
    seconds: float
    engines: list[str]


def feed(receiver: WeightReceiver, joiners: list[EngineEndpoint], config: SyncConfig) -> FeedResult:
    """Steps 1-3 on the feeding engine (blocking: run it off the engine's event loop). `config`: the
    group's transport settings (`master_address` the feeder's address toward the joiners). Raises
    ValueError if this engine holds no copy to feed, `sync.engine_set.SyncError` if a joiner fails
    (the joiners that did not commit serve what they served before)."""
    start = time.perf_counter()
    version, tensors = receiver.snapshot()
    config = dataclasses.replace(
        config, transport="broadcast", group_name=FEED_GROUP, pause_mode="abort", delta=DeltaConfig()
    )
    sender = WeightSender(joiners, config, version=-1)  # any version the joiners serve is older
    try:
        stats = sender.update(iter(tensors.items()), version)
    finally:
        sender.close()
    return FeedResult(version, stats.bytes, time.perf_counter() - start, stats.engines)
