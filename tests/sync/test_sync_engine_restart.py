"""Engines dying and coming back, at the sync layer: receiver-only engines (real processes, a real gloo
group, a real `WeightReceiver`) and the real sender.

Proves: a receiver SIGKILLed mid-broadcast fails the update within seconds, not `timeout_s`, and
the same version retried commits on the live engine; a restarted engine added back is caught up
to the committed version without pausing the others; an engine dead before the group re-forms
aborts the rendezvous at once (no wait for `timeout_s`) and the retry commits on the rest; a new
sender (the trainer restarted from an older run checkpoint) rolls engines that kept running back
to its version.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from sync.config import SyncConfig
from sync.engine_set import SyncError
from sync.receiver_engine import ReceiverEngineClient, start_receiver_engine
from sync.sender import WeightSender
from tests.sync.test_sync_broadcast import assert_same, served

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

TIMEOUT_S = 60  # the collective timeout: every failure below must be detected far sooner


def timed_failure(sender, state, version) -> tuple[SyncError, float]:
    start = time.perf_counter()
    with pytest.raises(SyncError) as info:
        sender.update(iter(state.items()), version)
    return info.value, time.perf_counter() - start


@pytest.mark.parametrize("engines", [[None, (2, 3)]], indirect=True)
def test_dead_engines_dropped_fast_and_restarted_engine_caught_up(engines, qwen3_moe_state, tmp_path):
    clients, procs = engines
    state2 = {k: v * 2 for k, v in qwen3_moe_state.items()}
    state3 = {k: v * 3 for k, v in qwen3_moe_state.items()}
    sender = WeightSender(clients, SyncConfig(bucket_bytes=8192, timeout_s=TIMEOUT_S))
    replacement = None
    try:
        sender.update(iter(qwen3_moe_state.items()), version=1)
        # 1. engine-1 SIGKILLs itself when bucket 3 of version 2 is announced (mid-broadcast)
        error, seconds = timed_failure(sender, state2, 2)
        assert (error.engine, error.bucket, error.dropped) == ("engine-1", 3, ["engine-1"])
        assert seconds < 10, f"dead receiver detected after {seconds:.1f} s"
        assert sender.engines.names == ["engine-0"] and sender.version == 1
        stats = sender.update(iter(state2.items()), version=2)  # the retry: the live engine commits
        assert stats.engines == ["engine-0"] and clients[0].served_version() == 2

        # 2. engine-1 restarted (a fresh process, serving version 0) and added back: behind
        replacement, port = start_receiver_engine(timeout_s=TIMEOUT_S)
        engine1 = ReceiverEngineClient(port, name="engine-1")
        sender.add(engine1, served_version=0)
        assert sender.behind == {"engine-1"}
        stats = sender.update(iter(state2.items()), version=2)  # catch-up: the committed version
        assert stats.engines == ["engine-1"] and not sender.behind
        for engine in (clients[0], engine1):
            assert engine.served_version() == 2
            assert_same(served(engine, tmp_path), state2)
        with pytest.raises(ValueError, match="stale or repeated"):  # nobody behind any more
            sender.update(iter(state2.items()), version=2)

        # 3. engine-0 dies between syncs; version 3 re-forms the group with both members: the
        #    rendezvous is aborted when engine-0 cannot join, and the retry commits on engine-1
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].join(10)
        error, seconds = timed_failure(sender, state3, 3)
        assert error.dropped == ["engine-0"] and seconds < 10, (error, seconds)
        assert engine1.served_version() == 2
        stats = sender.update(iter(state3.items()), version=3)
        assert stats.engines == ["engine-1"] and sender.version == 3
        assert engine1.served_version() == 3
        assert_same(served(engine1, tmp_path), state3)
    finally:
        sender.close()
        if replacement is not None:
            replacement.kill()
            replacement.join(5)


def test_a_new_sender_rolls_kept_engines_back_to_its_version(engines, qwen3_moe_state, tmp_path):
    """The trainer restarted from the run checkpoint of version 2 while the engines kept serving 3:
    the engines leave the dead source's group, its new sender takes them as serving weights it
    never sent (`add(engine, None)`), forms its group under the same name and commits version 2."""
    clients, _ = engines
    states = {v: {k: t * v for k, t in qwen3_moe_state.items()} for v in (1, 2, 3)}
    old = WeightSender(clients, SyncConfig(bucket_bytes=8192, timeout_s=TIMEOUT_S))
    for version in (1, 2, 3):
        old.update(iter(states[version].items()), version)
    old.transport.group.destroy()  # its process died: the engines still hold their side of the group,
    # which the orchestrator has them leave (`EngineServer.adopt`)
    assert not old.engines.call(lambda e: e.destroy_weights_update_group(old.config.group_name))
    new = WeightSender(clients, SyncConfig(bucket_bytes=8192, timeout_s=TIMEOUT_S), version=2)
    try:
        for engine in clients:
            new.add(engine, served_version=None)
        assert new.behind == {"engine-0", "engine-1"} and new.pending(2)
        assert new.update(iter(states[2].items()), 2).engines == ["engine-0", "engine-1"]
        for engine in clients:
            assert engine.served_version() == 2
            assert_same(served(engine, tmp_path), states[2])
        new.update(iter(states[3].items()), 3)  # and on from there, over the same group
        for engine in clients:
            assert engine.served_version() == 3
            assert_same(served(engine, tmp_path), states[3])
    finally:
        new.close()
