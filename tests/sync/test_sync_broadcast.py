"""Broadcast transport end to end: sender (this process, gloo) -> receiver-only engines (processes)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from sync.config import SyncConfig
from sync.sender import WeightSender

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)


def served(engine, tmp_path) -> dict[str, torch.Tensor]:
    path = tmp_path / f"{engine.name}.safetensors"
    engine.dump_weights(str(path))
    return load_file(path)


def assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


@pytest.mark.parametrize("bucket_bytes", [4096, 1 << 20])
def test_sync_two_versions_exact(engines, qwen3_moe_state, tmp_path, bucket_bytes):
    clients, _ = engines
    sender = WeightSender(clients, SyncConfig(bucket_bytes=bucket_bytes, timeout_s=20))
    try:
        stats = sender.update(iter(qwen3_moe_state.items()), version=1)
        assert stats.bytes == sum(t.numel() * t.element_size() for t in qwen3_moe_state.values())
        for engine in clients:
            assert engine.served_version() == 1
            assert_same(served(engine, tmp_path), qwen3_moe_state)
        # the group is reused: a second version, new values
        state2 = {k: v + 1 if v.is_floating_point() else v for k, v in qwen3_moe_state.items()}
        sender.update(iter(state2.items()), version=2)
        for engine in clients:
            assert engine.served_version() == 2
            assert_same(served(engine, tmp_path), state2)
        with pytest.raises(ValueError, match="stale or repeated"):
            sender.update(iter(state2.items()), version=2)
    finally:
        sender.close()
