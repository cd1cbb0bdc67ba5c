"""The project's client and WeightSender (kind sglang) against SGLang twins (SGLang's own weight
code in real processes, `sglang_twin.py`): two engines of tp 2, world size 5."""

from __future__ import annotations

import hashlib
import os
import signal

import pytest
import torch
from safetensors.torch import load_file

from moe_rl.engine.client import EngineClient
from sync.config import SyncConfig
from sync.engine_set import SyncError
from sync.sender import WeightSender
from tests.conformance.sglang_twin import SGLangTwin

pytestmark = [pytest.mark.timeout(600), pytest.mark.world]


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def _version(base: dict[str, torch.Tensor], v: int) -> dict[str, torch.Tensor]:
    """Weights of version v: every tensor differs from every other version's."""
    generator = torch.Generator().manual_seed(v)
    return {name: t + torch.randn(t.shape, generator=generator).to(t.dtype) for name, t in base.items()}


def _sender(twins) -> WeightSender:
    clients = [
        EngineClient(t.url, kind="sglang", name=f"twin-{i}", retries=1, timeout_s=60) for i, t in enumerate(twins)
    ]
    return WeightSender(clients, SyncConfig(transport="broadcast", bucket_bytes=16 << 10, timeout_s=60))


def _assert_serves(twin: SGLangTwin, weights: dict[str, torch.Tensor], version: str) -> None:
    expected = {name: _digest(t) for name, t in weights.items()}
    for rank, state in enumerate(twin.state()):
        assert state["version"] == version, (rank, state["version"])
        assert state["weights"] == expected, f"rank {rank} does not hold version {version} bit for bit"
        assert state["paused"] is None and not state["session"]


def test_two_tp2_twins_take_two_versions_bit_exact(twins, model_dir, monkeypatch):
    """...with no checksum computed: SGLang has no field for one (nor a host copy to hash)."""
    import sync.bucket

    hashed = []
    monkeypatch.setattr(sync.bucket, "checksum", lambda data: hashed.append(data.numel()) or "crc32:0")
    base = load_file(os.path.join(model_dir, "model.safetensors"))
    sender = _sender(twins)
    try:
        for version in (1, 2):
            weights = _version(base, version)
            stats = sender.update(iter(weights.items()), version)
            assert sorted(stats.engines) == ["twin-0", "twin-1"] and not stats.dropped
            for twin in twins:
                _assert_serves(twin, weights, str(version))
    finally:
        sender.close()
    for twin in twins:
        log = twin.log()
        assert all(entry["success"] for entry in log), [e for e in log if not e["success"]]
        routes = [e["route"] for e in log]
        assert routes.count("/init_weights_update_group") == 1 and routes.count("/begin_weight_update") == 2
        for entry in log:  # the label moves only at the commit, never with a bucket
            if entry["route"] == "/update_weights_from_distributed":
                assert entry["weight_version"] is None and entry["before"] == entry["after"]
        commits = [e for e in log if e["route"] == "/update_weight_version"]
        assert [(c["before"], c["after"]) for c in commits] == [(["0", "0"], ["1", "1"]), (["1", "1"], ["2", "2"])]
    assert hashed == []


def test_rank_killed_mid_version_never_serves_a_mix(twins, model_dir):
    base = load_file(os.path.join(model_dir, "model.safetensors"))
    sender = _sender(twins)
    victim_rank = twins[0].get("/twin/ranks")[1]
    try:
        v1 = _version(base, 1)
        sender.update(iter(v1.items()), 1)

        def killing(weights, after):
            for i, item in enumerate(weights.items()):
                if i == after:
                    os.kill(victim_rank, signal.SIGKILL)  # twin-0 loses TP rank 1 mid-version
                yield item

        v2 = _version(base, 2)
        with pytest.raises(SyncError) as failure:
            sender.update(killing(v2, after=len(v2) // 2), 2)
        assert failure.value.dropped == ["twin-0"]
        assert sender.partial == {"twin-1"}
        survivor = twins[1].state()
        for state in survivor:  # partly loaded, still labelled 1: it must not serve
            assert state["version"] == "1" and state["paused"] is not None and not state["session"]
        # the retry (a fresh export) gives the live engine the full version; the run goes on
        stats = sender.update(iter(v2.items()), 2)
        assert stats.engines == ["twin-1"] and sender.partial == set()
        _assert_serves(twins[1], v2, "2")
        v3 = _version(base, 3)
        sender.update(iter(v3.items()), 3)
        _assert_serves(twins[1], v3, "3")
    finally:
        sender.close()
    assert not twins[0].process.is_alive()  # SGLang's server goes down with a scheduler


def test_in_place_pause_syncs_without_the_flush_sglang_refuses(model_dir):
    import asyncio

    from moe_rl.engine.client import EngineError

    base = load_file(os.path.join(model_dir, "model.safetensors"))
    with SGLangTwin(model_dir, tp_size=1, running_requests=2) as twin:  # in_place keeps 2 requests running
        client = EngineClient(twin.url, kind="sglang", name="twin", retries=0)
        sender = WeightSender([client], SyncConfig(bucket_bytes=16 << 10, timeout_s=60, pause_mode="in_place"))
        try:
            v1 = _version(base, 1)
            sender.update(iter(v1.items()), 1)
        finally:
            sender.close()
        _assert_serves(twin, v1, "1")
        assert "/flush_cache" not in [e["route"] for e in twin.log()]

        async def flush_while_paused_in_place():
            await client.pause_generation("in_place")
            try:
                await client.flush_cache()
            finally:
                await client.close()

        with pytest.raises(EngineError, match="HTTP 400"):  # what a flush would have met
            asyncio.run(flush_while_paused_in_place())


def _fp8_dir(model_dir: str, out) -> tuple[str, dict[str, torch.Tensor]]:
    """`model_dir` stored as DeepSeek stores FP8 weights (8 x 8 blocks here); its tensors."""
    import json

    from safetensors.torch import save_file

    from parallel.fp8 import BlockFP8

    block = BlockFP8(8, 8)
    tensors = dict(block.quantize_stream(sorted(load_file(os.path.join(model_dir, "model.safetensors")).items())))
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads(open(os.path.join(model_dir, "config.json")).read())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": block.hf_config()}))
    return str(out), tensors


def test_fp8_blocks_travel_through_sglangs_bucket_code(model_dir, tmp_path):
    """sync.fp8_blocks against a twin serving FP8: float8_e4m3fn weights and float32
    weight_scale_inv, through SGLang's FlattenedTensorBucket, held bit for bit by both TP ranks."""
    from parallel.fp8 import BlockFP8

    start, _ = _fp8_dir(model_dir, tmp_path / "fp8")
    block = BlockFP8(8, 8)
    weights = dict(
        block.quantize_stream(sorted(_version(load_file(os.path.join(model_dir, "model.safetensors")), 1).items()))
    )
    assert any(t.dtype == torch.float8_e4m3fn for t in weights.values())
    twin = SGLangTwin(start, tp_size=2).start().wait_ready()
    try:
        sender = _sender([twin])
        try:
            sender.update(iter(weights.items()), 1)
        finally:
            sender.close()
        _assert_serves(twin, weights, "1")
    finally:
        twin.stop()


def test_fp8_blocks_dequantize_as_sglangs_loader_does():
    """The checkpoint reader's dequantization equals SGLang's `block_quant_dequant` (what its FP8
    loader applies to such weights), blocks that do not divide the shape included."""
    import typing

    from parallel.fp8 import BlockFP8
    from tests.conformance import sglang_oracle

    sglang_dequant = sglang_oracle.extract(
        "sglang.srt.layers.quantization.fp8_utils", "block_quant_dequant", {"torch": torch, "List": typing.List}
    )
    block = BlockFP8(16, 16)
    for shape in ((64, 48), (37, 50), (4, 40, 24)):
        weight = torch.randn(*shape, generator=torch.Generator().manual_seed(len(shape)))
        quantized, scale_inv = block.quantize(weight)
        theirs = sglang_dequant(quantized, scale_inv, [16, 16], torch.float32)
        assert torch.equal(block.dequantize(quantized, scale_inv), theirs), shape
