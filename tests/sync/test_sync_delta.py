"""Delta sync end to end at the sync layer: the real sender (`sync.delta` on), receiver-only engines
(real processes, a real gloo group, a real `WeightReceiver`), and every fault the version chain
must catch.

Proves: a chain of deltas with its anchors leaves every engine bit-equal to a full sync, bf16 and
FP8 values with their float32 scales included, sending a fraction of the bytes; a lost bucket, a
duplicated one, a bucket of an older or of a later version (buckets reordered across versions), a
value corrupted on the wire and an engine killed mid-delta are each refused, no engine serves a
mixed version, and the next update, a full anchor, heals every engine.
"""

from __future__ import annotations

import pytest
import torch

from sync.config import DeltaConfig, SyncConfig
from sync.delta import encode
from sync.engine_set import SyncError
from sync.receiver_engine import ReceiverEngineClient, start_receiver_engine
from sync.sender import WeightSender
from sync.transports.broadcast import BroadcastTransport
from tests.sync.test_sync_broadcast import served

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

TIMEOUT_S = 20


class Training:
    """Served weights of a model trained at a small learning rate: fp32 masters, each version cast
    to bf16, one matrix quantized to FP8 (e4m3) with a float32 scale per row block."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self.masters = {name: tensor.float() for name, tensor in state.items()}
        self.generator = torch.Generator().manual_seed(0)

    def step(self, lr: float = 1e-3) -> dict[str, torch.Tensor]:
        for tensor in self.masters.values():
            tensor += lr * tensor.abs().mean() * torch.randn(tensor.shape, generator=self.generator)
        served = {name: tensor.to(torch.bfloat16) for name, tensor in self.masters.items()}
        name = next(n for n in served if n.endswith("down_proj.weight"))
        weight = self.masters[name]
        scale = weight.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0
        served[name] = (weight / scale).to(torch.float8_e4m3fn)
        served[name.removesuffix("weight") + "weight_scale_inv"] = scale.squeeze(1)
        return served


def assert_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name


def delta_sender(clients, transport=None, full_every: int = 4) -> WeightSender:
    config = SyncConfig(bucket_bytes=8192, timeout_s=TIMEOUT_S, delta=DeltaConfig(enabled=True, full_every=full_every))
    return WeightSender(clients, config, transport=transport)


def test_a_delta_chain_equals_a_full_sync_bit_for_bit(engines, qwen3_moe_state, tmp_path):
    clients, _ = engines
    training = Training(qwen3_moe_state)
    sender = delta_sender(clients, full_every=4)
    try:
        kinds = []
        for version in range(1, 8):
            state = training.step()
            stats = sender.update(iter(state.items()), version)
            kinds.append("anchor" if stats.delta.anchor else "delta")
            if not stats.delta.anchor:  # the payloads are what travelled
                assert stats.bytes == stats.delta.wire_bytes < 0.5 * stats.delta.dense_bytes
                assert 0 < stats.delta.changed_fraction < 0.5
            for engine in clients:
                assert engine.served_version() == version
                assert_bits(served(engine, tmp_path), state)
        assert kinds == ["anchor", "delta", "delta", "delta", "anchor", "delta", "delta"]
    finally:
        sender.close()


class FaultyWire(BroadcastTransport):
    """The broadcast transport with one fault injected into the next delta's stream (a fault of the
    wire or of the sender, which the engines must catch)."""

    fault: str | None = None
    later: list[tuple[str, torch.Tensor]] = []  # payloads of the version after the faulty one

    def send(self, named_tensors, version, engines):
        stream = list(named_tensors)
        if self.delta and self.fault is not None:
            fault, self.fault = self.fault, None
            name, payload = stream[0]
            if fault == "lost bucket":
                stream = stream[1:]
            elif fault == "duplicated bucket":
                stream = stream + stream[:1]
            elif fault == "older version":  # a payload that applies on the version before the served one
                stream[0] = (name, encode(torch.zeros(1), torch.ones(1), version - 2, version - 1))
            elif fault == "later version":  # the next version's payload, arrived early
                stream[0] = self.later[0]
            elif fault == "corrupted value":
                corrupted = payload.clone()
                corrupted[-1] ^= 0x10
                stream[0] = (name, corrupted)
        return super().send(iter(stream), version, engines)


@pytest.mark.parametrize(
    "fault", ["lost bucket", "duplicated bucket", "older version", "later version", "corrupted value"]
)
def test_a_faulty_delta_is_refused_and_healed_by_an_anchor(engines, qwen3_moe_state, tmp_path, fault):
    clients, _ = engines
    training = Training(qwen3_moe_state)
    transport = FaultyWire(
        SyncConfig(bucket_bytes=8192, timeout_s=TIMEOUT_S, delta=DeltaConfig(enabled=True, full_every=50))
    )
    sender = delta_sender(clients, transport, full_every=50)
    try:
        states = {version: training.step() for version in (1, 2, 3)}
        sender.update(iter(states[1].items()), 1)  # the anchor
        if fault == "later version":  # a payload of version 3 on version 2 (made from a side copy)
            name = next(iter(states[3]))
            transport.later = [(name, encode(states[3][name], states[2][name], 2, 3))]
        if fault == "corrupted value":  # a tensor that changed, so its payload ends in values
            name = next(n for n in states[2] if not torch.equal(states[2][n], states[1][n]))
            states[2] = {name: states[2][name], **{n: t for n, t in states[2].items() if n != name}}
        transport.fault = fault
        with pytest.raises(SyncError):
            sender.update(iter(states[2].items()), 2)
        for engine in clients:  # refused whole: still version 1, bit for bit, paused until the anchor
            assert engine.served_version() == 1
            assert_bits(served(engine, tmp_path), states[1])
        assert sender.partial == {"engine-0", "engine-1"} and sender.kept.version is None
        stats = sender.update(iter(states[2].items()), 2)  # the retry is a full anchor
        assert stats.delta.anchor and not sender.partial
        stats = sender.update(iter(states[3].items()), 3)  # and the chain goes on
        assert not stats.delta.anchor
        for engine in clients:
            assert engine.served_version() == 3
            assert_bits(served(engine, tmp_path), states[3])
    finally:
        sender.close()


@pytest.mark.parametrize("engines", [[None, (3, 2)]], indirect=True)
def test_an_engine_killed_mid_delta_rejoins_on_an_anchor(engines, qwen3_moe_state, tmp_path):
    clients, procs = engines
    training = Training(qwen3_moe_state)
    sender = delta_sender(clients, full_every=50)
    replacement = None
    try:
        states = {version: training.step() for version in (1, 2, 3, 4)}
        sender.update(iter(states[1].items()), 1)
        assert not sender.update(iter(states[2].items()), 2).delta.anchor
        # engine-1 SIGKILLs itself at bucket 2 of version 3, a delta: dropped, engine-0 untouched
        with pytest.raises(SyncError) as failure:
            sender.update(iter(states[3].items()), 3)
        assert failure.value.dropped == ["engine-1"]
        assert clients[0].served_version() == 2
        assert_bits(served(clients[0], tmp_path), states[2])
        stats = sender.update(iter(states[3].items()), 3)  # the retry: an anchor (the chain broke)
        assert stats.delta.anchor and stats.engines == ["engine-0"]
        # restarted (a fresh process holding nothing) and added back: a full catch-up, then deltas
        replacement, port = start_receiver_engine(timeout_s=TIMEOUT_S)
        sender.add(ReceiverEngineClient(port, name="engine-1"), served_version=0)
        assert sender.update(iter(states[3].items()), 3).delta.anchor
        stats = sender.update(iter(states[4].items()), 4)
        assert not stats.delta.anchor and stats.engines == ["engine-0", "engine-1"]
        for engine in sender.engines.engines:
            assert engine.served_version() == 4
            assert_bits(served(engine, tmp_path), states[4])
    finally:
        sender.close()
        if replacement is not None:
            replacement.kill()
