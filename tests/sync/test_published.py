"""Versions on shared storage (`sync.published`): anchors, zstd delta files, chains resolved exactly."""

from __future__ import annotations

import pytest
import torch

from sync import published
from sync.delta import AppliedCopy, KeptCopy, bits


def versions(count: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """`count` versions of a few bf16/fp8/fp32 tensors, each changing a few elements of the last."""
    generator = torch.Generator().manual_seed(seed)
    state = {
        "w": torch.randn(64, 48, generator=generator).to(torch.bfloat16),
        "q": torch.randn(32, 16, generator=generator).to(torch.float8_e4m3fn),
        "scale": torch.rand(4, generator=generator),
    }
    out = [state]
    for _ in range(count - 1):
        state = {name: t.clone() for name, t in state.items()}
        for t in state.values():
            flat = t.view(-1)
            where = torch.randint(0, flat.numel(), (3,), generator=generator)
            flat[where] = (torch.randn(3, generator=generator) * 3).to(t.dtype)
        out.append(state)
    return out


def publish_chain(root, states, anchor_every: int = 100):
    """Publish `states` as versions 1..N: an anchor at 1 (and every `anchor_every`), deltas between."""
    root.mkdir(exist_ok=True)
    kept = KeptCopy()
    for version, state in enumerate(states, start=1):
        full = (version - 1) % anchor_every == 0
        stream = kept.encode_stream(iter(state.items()), version, full=full)
        published.publish(root, stream, version, bucket_bytes=1024, delta=not full)
        published.prune(root)


def assert_bit_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(bits(got[name]), bits(want[name])), name


def test_chain_resolves_bit_exact_from_the_anchor(tmp_path):
    states = versions(6)
    publish_chain(tmp_path, states)
    assert not published.is_delta(tmp_path / "v1") and all(published.is_delta(tmp_path / f"v{v}") for v in range(2, 7))
    assert list((tmp_path / "v3").glob("delta-*.safetensors.zst")) and not list((tmp_path / "v3").glob("*.safetensors"))
    for version, state in enumerate(states, start=1):
        tensors, got = published.resolve(tmp_path / f"v{version}")
        assert got == version
        assert_bit_equal(tensors, state)


def test_chain_starts_from_the_held_version_without_the_anchor(tmp_path):
    states = versions(4)
    publish_chain(tmp_path, states)
    held = AppliedCopy()
    held.hold(states[2], 3)
    before = {name: t.clone() for name, t in held.tensors.items()}
    for file in (tmp_path / "v1").iterdir():  # the anchor is not read: the engine holds v3
        file.unlink()
    tensors, version = published.resolve(tmp_path / "v4", held)
    assert version == 4
    assert_bit_equal(tensors, states[3])
    assert_bit_equal(held.tensors, before)  # the served copy is untouched
    with pytest.raises(ValueError, match="no \\*.safetensors files"):
        published.resolve(tmp_path / "v4")  # without it, the chain needs the (emptied) anchor


def test_prune_keeps_the_newest_anchor_and_its_deltas(tmp_path):
    publish_chain(tmp_path, versions(7), anchor_every=3)  # anchors 1, 4, 7
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v7"]
    publish_chain(tmp_path / "b", versions(6), anchor_every=3)
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["v4", "v5", "v6"]


def test_broken_chains_are_refused(tmp_path):
    publish_chain(tmp_path, versions(4))
    (tmp_path / "v2").rename(tmp_path / "gone")
    with pytest.raises(ValueError, match="applies on version 2, but .*v2 is not published"):
        published.resolve(tmp_path / "v4")
    (tmp_path / "gone").rename(tmp_path / "v2")
    (file,) = (tmp_path / "v3").glob("delta-*.zst")
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="v3"):  # unreadable, or its hash fails: named either way
        published.resolve(tmp_path / "v4")


def test_a_delta_of_mixed_bases_is_not_published(tmp_path):
    old, new = KeptCopy(), KeptCopy()
    states = versions(3)
    list(old.encode_stream(iter(states[0].items()), 1, full=True))
    list(new.encode_stream(iter(states[0].items()), 1, full=True))
    list(new.encode_stream(iter(states[1].items()), 2, full=True))
    mixed = [next(old.encode_stream(iter(states[2].items()), 3, full=False))]
    mixed += list(new.encode_stream(iter(list(states[2].items())[1:]), 3, full=False))
    with pytest.raises(ValueError, match="payloads apply on versions \\[1, 2\\]"):
        published.publish(tmp_path, iter(mixed), 3, bucket_bytes=1024, delta=True)
    assert not list(tmp_path.iterdir())  # nothing half-written stays
