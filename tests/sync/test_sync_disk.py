"""Disk transport: safetensors published by atomic rename, engines load them by path."""

from __future__ import annotations

import pytest
import torch

from sync import published
from sync.config import DeltaConfig, SyncConfig
from sync.sender import WeightSender
from sync.transports import available_transports, make_transport
from sync.transports.base import TransportConfig
from tests.sync.test_sync_broadcast import assert_same, served

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)


def test_disk_sync_exact(engines, qwen3_moe_state, tmp_path):
    clients, _ = engines
    shared = tmp_path / "shared"
    sender = WeightSender(clients, SyncConfig(transport="disk", disk_dir=str(shared), bucket_bytes=16384, timeout_s=20))
    try:
        sender.update(iter(qwen3_moe_state.items()), version=1)
        assert len(list((shared / "v1").glob("*.safetensors"))) > 1  # sharded by bucket_bytes
        state2 = {k: v * 2 for k, v in qwen3_moe_state.items()}
        sender.update(iter(state2.items()), version=2)
        assert sorted(p.name for p in shared.iterdir()) == ["v2"]  # published, old one removed
        for engine in clients:
            assert engine.served_version() == 2
            assert_same(served(engine, tmp_path), state2)
    finally:
        sender.close()


def test_disk_catch_up_loads_the_published_version(engines, qwen3_moe_state, tmp_path):
    """A restarted engine added back behind the committed version loads the directory already
    published for it; nothing is written again."""
    clients, _ = engines
    shared = tmp_path / "shared"
    sender = WeightSender(
        clients[:1], SyncConfig(transport="disk", disk_dir=str(shared), bucket_bytes=16384, timeout_s=20)
    )
    try:
        sender.update(iter(qwen3_moe_state.items()), version=1)
        published = {p.name: p.stat().st_mtime_ns for p in (shared / "v1").iterdir()}
        sender.add(clients[1], served_version=0)
        stats = sender.update(iter(qwen3_moe_state.items()), version=1)
        assert stats.engines == [clients[1].name] and not sender.behind
        assert {p.name: p.stat().st_mtime_ns for p in (shared / "v1").iterdir()} == published
        assert clients[1].served_version() == 1
        assert_same(served(clients[1], tmp_path), qwen3_moe_state)
    finally:
        sender.close()


def test_registry_names_what_is_missing():
    assert {"broadcast", "disk"} <= set(available_transports())
    with pytest.raises(ValueError, match="not one of"):
        make_transport("carrier-pigeon", TransportConfig())
    with pytest.raises(ValueError, match="disk_dir"):
        make_transport("disk", TransportConfig())


def test_disk_deltas_chain_and_a_restarted_engine_catches_up_from_storage(engines, qwen3_moe_state, tmp_path):
    """`sync.delta` on the disk transport: an anchor, then zstd delta files, each engine bit-exact at
    every version; an engine that joins late resolves anchor + chain from storage alone."""
    clients, _ = engines
    shared = tmp_path / "shared"
    config = SyncConfig(
        transport="disk", disk_dir=str(shared), bucket_bytes=16384, timeout_s=20, delta=DeltaConfig(enabled=True)
    )
    sender = WeightSender(clients[:1], config)
    states = [qwen3_moe_state]
    try:
        for version in (1, 2, 3):
            if version > 1:  # an RL step's worth of change: a few elements of each tensor
                states.append({k: nudged(v, version) for k, v in states[-1].items()})
            stats = sender.update(iter(states[-1].items()), version)
            assert stats.delta.anchor == (version == 1)
            assert_same(served(clients[0], tmp_path), states[-1])
        assert published.is_delta(shared / "v3") and not published.is_delta(shared / "v1")
        assert stats.delta.wire_fraction < 0.1
        files = {p.name: p.stat().st_mtime_ns for p in shared.rglob("*")}
        sender.add(clients[1], served_version=0)
        sender.update(iter(states[-1].items()), version=3)  # the catch-up: v1 + v2 + v3 from storage
        assert {p.name: p.stat().st_mtime_ns for p in shared.rglob("*")} == files  # nothing written
        assert clients[1].served_version() == 3
        assert_same(served(clients[1], tmp_path), states[-1])
        states.append({k: nudged(v, 4) for k, v in states[-1].items()})
        stats = sender.update(iter(states[-1].items()), version=4)  # both engines, a delta again
        assert not stats.delta.anchor
        for engine in clients:
            assert_same(served(engine, tmp_path), states[-1])
    finally:
        sender.close()


def nudged(tensor, seed: int):
    """`tensor` with ~1% of its elements (at least one) set to new values."""
    out = tensor.clone().view(-1)
    generator = torch.Generator().manual_seed(seed)
    where = torch.randint(0, out.numel(), (max(1, out.numel() // 100),), generator=generator)
    out[where] = out[where] + 1
    return out.view(tensor.shape)
