"""Failures: a corrupted bucket, an engine killed mid-sync, stale versions. Engines never serve
a half-updated model, and the sender's error names the engine and the bucket."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from sync.config import SyncConfig
from sync.engine_set import SyncError
from sync.receiver import WeightReceiver
from sync.sender import WeightSender
from sync.transports.broadcast import BroadcastTransport
from tests.sync.test_sync_broadcast import assert_same, served

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)


class CorruptingBroadcast(BroadcastTransport):
    """FAULT INJECTION: flips one byte of bucket `corrupt_bucket` after its checksum was taken."""

    corrupt_bucket = 2

    def _broadcast(self, bucket, version, engines):
        if bucket.index == self.corrupt_bucket:
            bucket.data[0] ^= 0xFF
        return super()._broadcast(bucket, version, engines)


def test_corrupted_bucket_rejected_engines_keep_old_version(engines, qwen3_moe_state, tmp_path):
    clients, _ = engines
    sender = WeightSender(clients, SyncConfig(bucket_bytes=8192, timeout_s=20))
    try:
        sender.update(iter(qwen3_moe_state.items()), version=1)
        state2 = {k: v * 2 for k, v in qwen3_moe_state.items()}
        sender.transport.__class__ = CorruptingBroadcast
        with pytest.raises(SyncError, match="bucket 2 .*checksum mismatch") as info:
            sender.update(iter(state2.items()), version=2)
        assert info.value.bucket == 2 and info.value.engine in {"engine-0", "engine-1"}
        for engine in clients:
            assert engine.served_version() == 1
            assert_same(served(engine, tmp_path), qwen3_moe_state)
        # the group survived (the collective itself succeeded): version 2 goes through
        sender.transport.__class__ = BroadcastTransport
        sender.update(iter(state2.items()), version=2)
        for engine in clients:
            assert engine.served_version() == 2
            assert_same(served(engine, tmp_path), state2)
    finally:
        sender.close()


@pytest.mark.parametrize("engines", [[None, (2, 3)]], indirect=True)
def test_engine_killed_mid_sync(engines, qwen3_moe_state, tmp_path):
    clients, procs = engines
    sender = WeightSender(clients, SyncConfig(bucket_bytes=8192, timeout_s=20))
    try:
        sender.update(iter(qwen3_moe_state.items()), version=1)
        state2 = {k: v * 2 for k, v in qwen3_moe_state.items()}
        with pytest.raises(SyncError, match="bucket 3 .*version 2 failed on engine-1") as info:
            sender.update(iter(state2.items()), version=2)
        assert (info.value.engine, info.value.bucket) == ("engine-1", 3)
        procs[1].join(10)
        assert procs[1].exitcode is not None  # it really died
        assert clients[0].served_version() == 1
        assert_same(served(clients[0], tmp_path), qwen3_moe_state)
        assert sender.engines.names == ["engine-0"]  # dropped: it could not resume
        # the next sync re-forms the group with the live engine and commits
        sender.update(iter(state2.items()), version=3)
        assert clients[0].served_version() == 3
        assert_same(served(clients[0], tmp_path), state2)
    finally:
        sender.close()


def test_receiver_versions_only_increase(tmp_path):
    save_file({"w": torch.arange(4.0)}, tmp_path / "model.safetensors")
    receiver = WeightReceiver()
    receiver.stage_from_disk(tmp_path, "1")
    assert torch.equal(receiver.commit("1")["w"], torch.arange(4.0)) and receiver.version == 1
    for stale in (1, 0, "1"):
        with pytest.raises(ValueError, match="stale or repeated"):
            receiver.stage_from_disk(tmp_path, stale)
    with pytest.raises(RuntimeError, match="nothing is staged"):
        receiver.commit(2)  # nothing staged for 2
    with pytest.raises(ValueError, match="not an integer"):
        receiver.stage_from_disk(tmp_path, "v2")
    with pytest.raises(RuntimeError, match="before join"):
        receiver.receive_bucket(["w"], ["float32"], [[4]], 2)
    receiver.stage_from_disk(tmp_path, 3)
    receiver.abort()  # an abandoned version is never served
    with pytest.raises(RuntimeError):
        receiver.commit(3)
    assert receiver.version == 1


def test_sender_refuses_stale_version(engines, qwen3_moe_state):
    clients, _ = engines
    sender = WeightSender(clients, SyncConfig(bucket_bytes=1 << 20, timeout_s=20), version=3)
    try:
        for version in (3, 2):
            with pytest.raises(ValueError, match="stale or repeated"):
                sender.update(iter(qwen3_moe_state.items()), version=version)
    finally:
        sender.close()
