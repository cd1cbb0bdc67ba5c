"""`sync.owner.DiffOwner` follows the announced decision (no world: one owner, payloads applied by
an engine's `AppliedCopy`), and the sender announces on every path, also when it fails before
deciding."""

from __future__ import annotations

import pytest
import torch

from sync.config import DeltaConfig, SyncConfig
from sync.delta import AppliedCopy, bits, header
from sync.owner import Decision, DiffOwner
from sync.receiver_engine import ReceiverEngineClient
from sync.sender import WeightSender

NAME = "model.layers.0.mlp.experts.1.down_proj.weight"


def _version(seed: int, base: torch.Tensor | None = None) -> torch.Tensor:
    """A bf16 expert weight; from `base`: ~3% of its elements moved."""
    gen = torch.Generator().manual_seed(seed)
    if base is None:
        return torch.randn(64, 32, generator=gen).to(torch.bfloat16)
    moved = torch.rand(base.shape, generator=gen) < 0.03
    return torch.where(moved, base + 0.25, base).to(torch.bfloat16)


def _send(owner: DiffOwner, decision: Decision | None, tensor: torch.Tensor) -> torch.Tensor:
    """One update of one expert as `Mapping.export` runs it on its owner; returns what crosses."""
    owner.begin(decision)
    out = []

    def export():
        if owner.encodes:
            out.append(owner.encode(NAME, tensor))
        else:
            owner.keep(NAME, tensor)
            out.append(tensor)
        yield NAME, out[-1]

    list(owner.follow(export()))
    return out[-1]


def test_an_owner_diffs_on_its_kept_version_and_goes_dense_otherwise():
    owner, engine = DiffOwner(), AppliedCopy()
    v1 = _version(1)
    assert _send(owner, Decision(1, False, 0, "auto"), v1) is v1  # an anchor: the tensor itself
    engine.hold({NAME: v1.clone()}, 1)
    v2 = _version(2, v1)
    payload = _send(owner, Decision(2, True, 1, "auto"), v2)
    assert header(payload).encoding != "dense" and payload.numel() < 0.5 * v2.numel() * 2
    assert engine.apply_stream([(NAME, payload)], 1) == 2
    assert torch.equal(bits(engine.tensors[NAME]), bits(v2))
    # the coordinator failed before deciding: sent dense, the kept version forgotten
    v3 = _version(3, v2)
    assert _send(owner, None, v3) is v3 and owner.kept.version is None
    # so the next delta is a dense payload naming the announced base, and applies on it
    v4 = _version(4, v3)
    payload = _send(owner, Decision(4, True, 2, "auto"), v4)
    assert (header(payload).encoding, header(payload).base_version, header(payload).version) == ("dense", 2, 4)
    assert engine.apply_stream([(NAME, payload)], 2) == 4
    assert torch.equal(bits(engine.tensors[NAME]), bits(v4)) and owner.kept.version == 4
    # a kept version other than the announced base (an update the engines never committed): dense
    payload = _send(owner, Decision(6, True, 5, "auto"), _version(6, v4))
    assert header(payload).encoding == "dense" and header(payload).base_version == 5


def test_the_sender_announces_none_when_it_fails_before_deciding():
    """The other ranks then export dense; the sender runs its own export out beside them."""
    sender = WeightSender([ReceiverEngineClient(1, name="engine-0")], SyncConfig(delta=DeltaConfig(enabled=True)))
    announced, export = [], iter([(NAME, _version(1))])
    sender.owners = announced.append
    with pytest.raises(ValueError, match="stale or repeated"):
        sender.update(export, 0)  # the committed version again, with no engine behind
    assert announced == [None] and next(export, None) is None
