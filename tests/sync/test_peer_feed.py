"""A live engine's receiver feeds the version it serves to joining engines (`sync.peer_feed`)."""

from __future__ import annotations

import pytest
import torch

from sync.config import SyncConfig
from sync.peer_feed import feed
from sync.receiver import WeightReceiver
from tests.sync.test_sync_broadcast import assert_same, served

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)


def serving(state: dict[str, torch.Tensor], version: int) -> WeightReceiver:
    """A receiver that committed `state` as `version` (what an engine keeps after a sync)."""
    receiver = WeightReceiver()
    receiver.stage_tensors(state, version)
    receiver.commit(version)
    return receiver


def test_feed_sends_the_served_version_exactly_and_commits_it(engines, qwen3_moe_state, tmp_path):
    clients, _ = engines
    feeder = serving(qwen3_moe_state, 7)
    result = feed(feeder, clients, SyncConfig(bucket_bytes=16384, timeout_s=20))
    assert result.version == 7 and sorted(result.engines) == [c.name for c in clients]
    assert result.bytes == sum(t.numel() * t.element_size() for t in qwen3_moe_state.values())
    for client in clients:
        assert client.served_version() == 7
        assert_same(served(client, tmp_path), qwen3_moe_state)


def test_snapshot_is_one_version_whatever_commits_after_it(qwen3_moe_state):
    feeder = serving(qwen3_moe_state, 1)
    version, copy = feeder.snapshot()
    doubled = {name: t * 2 for name, t in qwen3_moe_state.items()}
    feeder.stage_tensors(doubled, 2)
    feeder.commit(2)  # the next version, while a feed of the copy would still be running
    assert version == 1
    for name, tensor in qwen3_moe_state.items():
        assert torch.equal(copy[name], tensor)
    assert feeder.snapshot()[0] == 2


def test_an_engine_that_received_nothing_cannot_feed():
    with pytest.raises(ValueError, match="holds no copy of the version it serves"):
        WeightReceiver(version=3).snapshot()
