"""WeightReceiver storage: buckets land in two preallocated sets reused across versions, in
order, even when bucket calls arrive on several threads (a real gloo group, in one process)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import sync.receiver as receiver_module
from sync.bucket import BucketPacker
from sync.group import WeightUpdateGroup, host_store
from sync.receiver import WeightReceiver


@pytest.fixture
def joined():
    store = host_store("127.0.0.1", 2, timeout_s=30)
    receiver = WeightReceiver()
    joiner = threading.Thread(target=receiver.join, args=("127.0.0.1", store.port, 1, 2, "g", "gloo", 30))
    joiner.start()
    source = WeightUpdateGroup.join("127.0.0.1", store.port, 0, 2, "g", "gloo", 30, store=store)
    joiner.join()
    yield source, receiver
    receiver.leave()
    source.destroy()


def send(source, receiver, state, version, pool, corrupt=None):
    """Announce each bucket on a worker thread (as an HTTP server would), then broadcast it."""
    acks = []
    for bucket in BucketPacker(64, checksums=True).pack(state.items()):  # 16-byte tensors: 4 per bucket
        acks.append(
            pool.submit(
                receiver.receive_bucket,
                **bucket.announcement(),
                weight_version=version,
                checksum=f"{bucket.checksum}#{bucket.index}",
            )
        )
        if bucket.index == corrupt:
            bucket.data[0] ^= 0xFF
        source.broadcast(bucket.data)
    return [a.exception() for a in acks]


def test_two_storage_sets_reused_across_versions(joined):
    source, receiver = joined
    pool = ThreadPoolExecutor(2)
    served, addresses = [], []
    for version in (1, 2, 3, 4):
        state = {f"layer.{i}.w": torch.randn(4) + version for i in range(10)}
        assert send(source, receiver, state, version, pool) == [None] * 3
        tensors = receiver.commit(version)
        assert all(torch.equal(tensors[k], v) for k, v in state.items())
        if served:  # staging this version left the previous served one untouched
            assert all(torch.equal(served[-1][1][k], v) for k, v in served[-1][0].items())
        served.append((state, tensors))
        addresses.append({k: t.data_ptr() for k, t in tensors.items()})
    assert addresses[0] == addresses[2] and addresses[1] == addresses[3]
    assert set(addresses[0].values()).isdisjoint(addresses[1].values())


def test_corrupted_bucket_blocks_commit_group_stays_usable(joined):
    source, receiver = joined
    pool = ThreadPoolExecutor(2)
    state = {f"layer.{i}.w": torch.randn(4) for i in range(10)}
    errors = send(source, receiver, state, 1, pool, corrupt=1)
    # Bucket 0 acks whenever its checksum finishes; bucket 2's may finish before bucket 1's
    # rejection lands (checksums overlap the next receive), else it reports the version dropped.
    assert errors[0] is None and "checksum mismatch" in str(errors[1])
    assert errors[2] is None or "dropped (bucket 1 failed its checksum)" in str(errors[2])
    with pytest.raises(RuntimeError, match="rejected"):
        receiver.commit(1)
    receiver.abort()  # /continue_generation
    assert send(source, receiver, state, 1, pool) == [None] * 3
    tensors = receiver.commit(1)
    assert all(torch.equal(tensors[k], v) for k, v in state.items())


def test_a_bucket_verified_before_the_rejection_acks_even_if_its_ack_comes_later(joined, monkeypatch):
    """Bucket 0's checksum is held until bucket 1's rejection is recorded: bucket 0 still acks
    (its own bytes verified), so a sender reading acks in bucket order names bucket 1."""
    source, receiver = joined
    state = {f"layer.{i}.w": torch.randn(4) for i in range(10)}
    first = next(iter(BucketPacker(64, checksums=True).pack(state.items()))).data.clone()
    real = receiver_module.bucket_checksum

    def held_checksum(data):
        if torch.equal(data, first):
            for _ in range(30_000):  # until bucket 1's rejection is recorded (at most ~30 s)
                if receiver._rejected is not None:
                    break
                time.sleep(0.001)
        return real(data)

    monkeypatch.setattr(receiver_module, "bucket_checksum", held_checksum)
    errors = send(source, receiver, state, 1, ThreadPoolExecutor(3), corrupt=1)
    assert receiver._rejected == 1, "bucket 0 was never held behind bucket 1's rejection"
    assert errors[0] is None and "checksum mismatch" in str(errors[1])
    with pytest.raises(RuntimeError, match="bucket 1 failed its checksum"):
        receiver.commit(1)


def test_only_a_newly_joined_group_may_roll_the_receiver_back(joined):
    """Versions only increase over one group; the first commit after joining one may go back (a
    trainer restarted from an older run checkpoint while the engine kept running), once."""
    source, receiver = joined
    pool = ThreadPoolExecutor(2)
    states = {v: {f"layer.{i}.w": torch.randn(4) + v for i in range(10)} for v in (1, 2, 3)}
    for version in (1, 2, 3):
        assert send(source, receiver, states[version], version, pool) == [None] * 3
        receiver.commit(version)
    assert send(source, receiver, states[2], None, pool) == [None] * 3  # unlabelled: the commit names it
    with pytest.raises(ValueError, match="stale or repeated"):
        receiver.commit(2)
    receiver.abort()

    store = host_store("127.0.0.1", 2, timeout_s=30)  # a new source, under the same group name
    receiver.leave("g")
    joiner = threading.Thread(target=receiver.join, args=("127.0.0.1", store.port, 1, 2, "g", "gloo", 30))
    joiner.start()
    new_source = WeightUpdateGroup.join("127.0.0.1", store.port, 0, 2, "g", "gloo", 30, store=store)
    joiner.join()
    try:
        assert receiver.may_go_back
        assert send(new_source, receiver, states[2], None, pool) == [None] * 3
        tensors = receiver.commit(2)
        assert receiver.version == 2 and all(torch.equal(tensors[k], v) for k, v in states[2].items())
        assert not receiver.may_go_back
        assert send(new_source, receiver, states[1], None, pool) == [None] * 3
        with pytest.raises(ValueError, match="stale or repeated"):  # once only
            receiver.commit(1)
    finally:
        receiver.leave()
        new_source.destroy()
