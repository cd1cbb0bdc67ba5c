"""WeightReceiver storage: buckets land in two preallocated sets reused across versions, in
order, even when bucket calls arrive on several threads (a real gloo group, in one process)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

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
    assert "checksum mismatch" in str(errors[1])
    # Checksums run outside the bucket order, so bucket 1's rejection may land before or after
    # the other buckets' acks: each of them either succeeded or reports the version dropped.
    assert all(e is None or "dropped" in str(e) for e in (errors[0], errors[2]))
    with pytest.raises(RuntimeError, match="rejected"):
        receiver.commit(1)
    receiver.abort()  # /continue_generation
    assert send(source, receiver, state, 1, pool) == [None] * 3
    tensors = receiver.commit(1)
    assert all(torch.equal(tensors[k], v) for k, v in state.items())
