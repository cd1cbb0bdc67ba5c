"""CUDA-IPC transport: a clear error where CUDA is missing; on a GPU with sglang, a
round trip through SGLang's own serializer into another process (an SGLang-side FAKE engine:
it deserializes and rebuilds the flattened bucket exactly as SGLang's weight updater does)."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
import torch
import torch.multiprocessing as mp

from sync.transports import available_transports, make_transport
from sync.transports.base import TransportConfig
from sync.transports.cuda_ipc import missing_requirements

GPU_AND_SGLANG = torch.cuda.is_available() and importlib.util.find_spec("sglang") is not None


def test_registry_lists_cuda_ipc_and_names_what_is_missing():
    assert "cuda_ipc" in available_transports()
    if torch.cuda.is_available():
        pytest.skip("CUDA is present here")
    with pytest.raises(ValueError, match="transport 'cuda_ipc' needs CUDA") as info:
        make_transport("cuda_ipc", TransportConfig())
    for requirement in missing_requirements():
        assert requirement in str(info.value)


def test_the_engine_side_decoder_admits_the_storage_class_of_a_cuda_ipc_tensor():
    """torch's reduce_tensor names `type(tensor._typed_storage())` among rebuild_cuda_tensor's
    arguments; the engine's restricted unpickler must let that class through (seen on an H200)."""
    import io
    import pickle

    from sync.flattened_payload import _Unpickler

    storage_cls = type(torch.zeros(1)._typed_storage())
    assert _Unpickler(io.BytesIO(pickle.dumps(storage_cls))).load() is storage_cls
    with pytest.raises(pickle.UnpicklingError, match="not allowed"):
        _Unpickler(io.BytesIO(pickle.dumps(torch.storage.TypedStorage._new_shared))).load()


def _sglang_side(conn) -> None:
    """FAKE SGLang rank: deserialize its own payload, rebuild the bucket, keep CPU copies."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    monkey_patch_torch_reductions()
    weights = {}
    while (message := conn.recv()) is not None:
        payload = MultiprocessingSerializer.deserialize(message[0])
        bucket = FlattenedTensorBucket(flattened_tensor=payload["flattened_tensor"], metadata=payload["metadata"])
        weights.update((name, t.cpu().clone()) for name, t in bucket.reconstruct_tensors())
        torch.cuda.synchronize()
        conn.send("ok")
    conn.send(weights)


class IpcEngine:
    """ColocatedEngineEndpoint over a pipe to `_sglang_side` (only the routes this test uses)."""

    def __init__(self, name: str):
        self.name, self.version = name, None
        self.verifies_checksums = False  # SGLang's route: no checksum
        self.conn, child = mp.get_context("spawn").Pipe()
        self.proc = mp.get_context("spawn").Process(target=_sglang_side, args=(child,), daemon=True)
        self.proc.start()

    async def update_weights_from_tensor(self, serialized_named_tensors, load_format, weight_version):
        assert load_format == "flattened_bucket"
        self.conn.send(serialized_named_tensors)
        assert await asyncio.to_thread(self.conn.recv) == "ok"

    async def update_weight_version(self, new_version):
        self.version = new_version

    async def num_group_ranks(self) -> int:
        return 1

    async def custom_weight_loaders(self) -> list[str]:
        return []  # full versions, as flattened buckets

    async def health(self) -> bool:
        return self.proc.is_alive()

    async def begin_weight_update(self): ...
    async def end_weight_update(self): ...
    async def init_weights_update_group(self, *args): ...
    async def destroy_weights_update_group(self, group_name): ...
    async def update_weights_from_distributed(self, *args): ...
    async def update_weights_from_disk(self, model_path, weight_version): ...
    async def pause_generation(self, mode): ...
    async def continue_generation(self): ...
    async def flush_cache(self): ...

    def weights(self) -> dict:
        self.conn.send(None)
        return self.conn.recv()


@pytest.mark.gpu_sglang
@pytest.mark.skipif(not GPU_AND_SGLANG, reason="needs a CUDA GPU and sglang installed")
def test_cuda_ipc_round_trip_exact():
    from sync.config import SyncConfig
    from sync.sender import WeightSender

    state = {f"model.layers.{i}.w": torch.randn(256, 64, dtype=torch.bfloat16, device="cuda") for i in range(8)}
    engines = [IpcEngine("ipc-0"), IpcEngine("ipc-1")]
    sender = WeightSender(engines, SyncConfig(transport="cuda_ipc", bucket_bytes=3 * 256 * 64 * 2))
    try:
        assert sender.update(iter(state.items()), version=1).bytes == sum(t.nbytes for t in state.values())
    finally:
        sender.close()
    for engine in engines:
        got = engine.weights()
        assert engine.version == "1" and sorted(got) == sorted(state)
        assert all(torch.equal(got[k], v.cpu()) for k, v in state.items())
