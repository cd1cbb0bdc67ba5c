"""Weight updates into a live embedded engine: from disk, and over the gloo weight-update group
driven by `sync.sender.WeightSender` through `EngineClient` (the real protocol end to end)."""

from __future__ import annotations

import asyncio
import base64
import os
import pickle

import numpy as np
import pytest

from moe_rl.engine.client import EngineClient, EngineError
from moe_rl.engine.embedded.runner import load_checkpoint_state
from moe_rl.engine.process import EmbeddedConfig, launch_embedded
from moe_rl.engine.sampling import SamplingParams
from sync.config import SyncConfig
from sync.flattened_payload import flatten, serialize
from sync.sender import WeightSender
from tests.engine.engine_helpers import (
    load_reference,
    reference,
    run,
    save_tiny_model,
    wait_until_decoding,
    with_client,
)

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

PROMPTS = [[(3 * i + 7 * j) % 256 for j in range(4 + i)] for i in range(4)]


async def generate(client):
    return await asyncio.gather(
        *(
            client.generate(
                p, SamplingParams(max_new_tokens=8, sampling_seed=i, ignore_eos=True), return_routed_experts=True
            )
            for i, p in enumerate(PROMPTS)
        )
    )


def matches(model_dir, results):
    model = load_reference(model_dir)
    for prompt, result in zip(PROMPTS, results):
        logprobs, routing = reference(model, prompt, result.output_ids)
        if not np.allclose(result.logprobs, logprobs, atol=1e-4):
            return False
        assert np.array_equal(result.routed_experts, routing.numpy())
    return True


@pytest.fixture(scope="module")
def new_dir(tmp_path_factory):
    return save_tiny_model("qwen3_moe", tmp_path_factory.mktemp("qwen3_new"), seed=1)


@pytest.fixture
def engine(qwen3_dir):
    with launch_embedded(EmbeddedConfig(model_path=qwen3_dir, weight_version="0", threads=1)) as engine:
        yield engine


def test_update_from_disk(engine, qwen3_dir, new_dir, tmp_path):
    async def go(client):
        before = await generate(client)
        await client.update_weights_from_disk(str(new_dir), weight_version="1")
        after = await generate(client)
        with pytest.raises(EngineError, match="safetensors"):
            await client.update_weights_from_disk(str(tmp_path), weight_version="2")
        return before, after, await client.model_info()

    before, after, info = run(with_client(engine.url, go))
    assert all(r.weight_version == 0 for r in before) and matches(qwen3_dir, before)
    assert all(r.weight_versions == [1] * 8 for r in after) and info["weight_version"] == "1"
    assert matches(new_dir, after) and not matches(qwen3_dir, after)


def _decoding_meanwhile(url: str, items: list, decoded: list[dict]):
    """`items`, but after the first few tensors (buckets already on the wire) the stream waits until
    the engine decoded 3 more tokens of its running request: only an engine that keeps generating
    through the transfer lets the update go on."""
    for i, item in enumerate(items):
        if i == 8:
            decoded.append(run(wait_until_decoding(url, 1, steps=3)))
        yield item


@pytest.mark.parametrize("pause_mode", ["in_place", "none"])
def test_update_from_distributed_with_weight_sender(engine, qwen3_dir, new_dir, pause_mode):
    """Buckets of 8 KiB: many buckets, each announced, broadcast, verified and staged; the version
    is committed only at the end; requests in flight across the update keep going (in_place: paused
    in the batch; none: generating on version 0 while the buckets arrive, then on 1)."""
    client = EngineClient(engine.url)
    sender = WeightSender(
        [client], SyncConfig(transport="broadcast", bucket_bytes=8 << 10, pause_mode=pause_mode, timeout_s=60)
    )
    decoded: list[dict] = []
    try:

        async def in_flight():
            return await client.generate(
                PROMPTS[0], SamplingParams(max_new_tokens=300, sampling_seed=0, ignore_eos=True)
            )

        async def go():
            task = asyncio.create_task(in_flight())
            await wait_until_decoding(engine.url, 1)  # under way with version 0 when the update starts
            stream = sorted(load_checkpoint_state(new_dir).items())
            if pause_mode == "none":
                stream = _decoding_meanwhile(engine.url, stream, decoded)
            stats = await asyncio.to_thread(sender.update, stream, 1)
            return stats, await task, await generate(client)

        stats, crossing, after = run(go())
        assert stats.version == 1 and stats.bytes == sum(
            t.numel() * t.element_size() for t in load_checkpoint_state(new_dir).values()
        )
        assert crossing.finish_reason == "length" and len(crossing.output_ids) == 300
        assert crossing.weight_versions[0] == 0 and crossing.weight_versions[-1] == 1
        assert all(r.weight_version == 1 for r in after) and matches(new_dir, after)
        assert len(decoded) == (pause_mode == "none")  # the stream went on once the engine decoded
    finally:
        sender.close()
        run(client.close())


def _fp8_copy(model_dir, out_dir):
    """`model_dir` as DeepSeek ships its weights: linears in 8 x 8 FP8 blocks + weight_scale_inv."""
    import json

    from safetensors.torch import save_file

    from parallel.fp8 import BlockFP8

    block = BlockFP8(8, 8)
    out_dir.mkdir()
    save_file(
        dict(block.quantize_stream(sorted(load_checkpoint_state(model_dir).items()))),
        str(out_dir / "model.safetensors"),
    )
    config = json.loads((model_dir / "config.json").read_text())
    (out_dir / "config.json").write_text(json.dumps({**config, "quantization_config": block.hf_config()}))
    return out_dir, block


def test_fp8_weights_start_and_update_an_engine(qwen3_dir, new_dir, tmp_path):
    """sync.fp8_blocks: the engine starts from an FP8 checkpoint and takes FP8 buckets (weights +
    weight_scale_inv); it serves what transformers' own FP8 loader makes of the same files."""
    start, block = _fp8_copy(qwen3_dir, tmp_path / "start")
    update, _ = _fp8_copy(new_dir, tmp_path / "update")
    stream = sorted(block.quantize_stream(sorted(load_checkpoint_state(new_dir).items())))
    with launch_embedded(EmbeddedConfig(model_path=start, weight_version="0", threads=1)) as engine:
        client = EngineClient(engine.url)
        sender = WeightSender([client], SyncConfig(transport="broadcast", bucket_bytes=8 << 10, timeout_s=60))
        try:
            before = run(generate(client))
            stats = sender.update(stream, 1)
            after = run(generate(client))
        finally:
            sender.close()
            run(client.close())
    assert matches(start, before) and matches(update, after) and not matches(update, before)
    full = sum(t.numel() * t.element_size() for t in load_checkpoint_state(new_dir).values())
    assert stats.bytes == sum(t.numel() * t.element_size() for _, t in stream) < full / 2  # fp32 -> FP8


def test_update_from_tensor_payload(engine, qwen3_dir, new_dir):
    """`/update_weights_from_tensor` (the `cuda_ipc` transport's route): a flattened-bucket payload is
    staged in the session and served from the commit on; here by value (CPU tensors), on a GPU by
    CUDA-IPC handles (tests/gpu/test_sync_ipc.py). A payload naming any other global is refused."""
    state = load_checkpoint_state(new_dir)
    names = sorted(state)
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    payloads = [serialize(flatten({n: state[n] for n in half}), share=False) for half in halves]
    evil = base64.b64encode(pickle.dumps(os.system)).decode()

    async def go(client):
        with pytest.raises(EngineError, match="between begin_weight_update"):
            await client.update_weights_from_tensor([payloads[0]], "flattened_bucket", None)
        await client.begin_weight_update()
        with pytest.raises(EngineError, match="system is not allowed in a tensor payload"):
            await client.update_weights_from_tensor([evil], "flattened_bucket", None)
        for payload in payloads:
            await client.update_weights_from_tensor([payload], "flattened_bucket", None)
        await client.end_weight_update()
        assert (await client.model_info())["weight_version"] == "0"  # staged, not served yet
        await client.update_weight_version("1")
        return await generate(client)

    results = run(with_client(engine.url, go))
    assert all(r.weight_version == 1 for r in results)
    assert matches(new_dir, results) and not matches(qwen3_dir, results)


def test_weight_update_session_rules_are_sglangs(engine):
    """SGLang 0.5.23's rules (managers/scheduler_components/weight_updater.py): bucket routes only
    inside /begin_weight_update ... /end_weight_update, one session at a time; disk needs none."""

    async def go(client):
        bucket = dict(
            names=["w"],
            dtypes=["float32"],
            shapes=[[1]],
            group_name="weight_update_group",
            weight_version=None,
            load_format="flattened_bucket",
            checksum=None,
        )
        with pytest.raises(EngineError, match="between begin_weight_update"):
            await client.update_weights_from_distributed(**bucket)
        with pytest.raises(EngineError, match="no weight-update session is open"):
            await client.end_weight_update()
        await client.begin_weight_update()
        with pytest.raises(EngineError, match="already open"):
            await client.begin_weight_update()
        with pytest.raises(EngineError, match="init_weights_update_group first|before join"):
            await client.update_weights_from_distributed(**bucket)  # in a session, but no group
        await client.end_weight_update()
        await client.begin_weight_update()  # closed: a new one opens
        await client.end_weight_update()
        return await client.model_info()

    assert run(with_client(engine.url, go))["weight_version"] == "0"  # nothing committed


def test_weight_versions_are_integers_that_only_increase(engine, new_dir):
    async def go(client):
        for bad in ("abc", ["1"], "-1", "1.5", True):
            with pytest.raises(EngineError, match="not a weight version"):
                await client._request("POST", "/update_weight_version", {"new_version": bad})
        await client.update_weight_version("2")
        with pytest.raises(EngineError, match="not newer than the served version 2"):
            await client.update_weight_version("1")
        with pytest.raises(EngineError, match="not newer than the served version 2"):
            await client.update_weights_from_disk(str(new_dir), weight_version="1")
        await client.update_weights_from_disk(str(new_dir), weight_version="2")  # a reload of the served version
        await client._request("POST", "/update_weights_from_disk", {"model_path": str(new_dir), "weight_version": 3})
        return await client.model_info()

    assert run(with_client(engine.url, go))["weight_version"] == "3"


def test_joining_a_group_fails_fast_on_a_bad_backend_or_a_closed_port(engine):
    import socket
    import time

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]

    async def go(client):
        start = time.monotonic()
        with pytest.raises(EngineError, match="backend: 'mpi'"):
            await client.init_weights_update_group("127.0.0.1", closed, 1, 2, "g", "mpi")
        with pytest.raises(EngineError, match="needs CUDA"):
            await client.init_weights_update_group("127.0.0.1", closed, 1, 2, "g", "nccl")
        fast = time.monotonic() - start
        with pytest.raises(EngineError, match=f"nothing answers at 127.0.0.1:{closed}"):
            await client.init_weights_update_group("127.0.0.1", closed, 1, 2, "g", "gloo")
        return fast, await client.health()

    fast, healthy = run(with_client(engine.url, go))
    assert fast < 5 and healthy  # validated before any connection attempt; the engine keeps serving
