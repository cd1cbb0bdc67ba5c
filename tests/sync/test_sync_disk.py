"""Disk transport: safetensors published by atomic rename, engines load them by path."""

from __future__ import annotations

import pytest

from sync.config import SyncConfig
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
