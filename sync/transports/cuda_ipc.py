"""CUDA-IPC transport for colocated engines: SGLang's `/update_weights_from_tensor`, no copy on a wire.

For engines on the trainer's own GPUs (colocated), the bytes need not move at all: the source
rank packs each bucket into a GPU buffer and hands the engines CUDA-IPC handles to it. Per
bucket, on the source rank:
  1. pack it into one of two GPU buffers (`BucketPacker`, double-buffered) and synchronize the
     stream, so the copy is complete before another process maps the memory;
  2. build SGLang's flattened-bucket payload `{"flattened_tensor": uint8 GPU tensor,
     "metadata": [FlattenedTensorMetadata(name, shape, dtype, start_idx, end_idx, numel)]}` and
     serialize it with SGLang's `MultiprocessingSerializer` (ForkingPickler: CUDA-IPC handles,
     after `monkey_patch_torch_reductions`, which names the device by UUID), base64 for JSON,
     once per engine TP rank (`num_group_ranks()`, SGLang's tp_size): each SGLang rank deserializes only its own copy
     (SGLang's refcount contract, `tp_worker.deserialize_own_rank`);
  3. `update_weights_from_tensor(serialized_named_tensors, load_format="flattened_bucket",
     weight_version)` on every engine; the call returns once the engine copied the bucket into its
     weights (the ack). Only then is the buffer packed again (bucket k+2); packing bucket k+1
     overlaps the engines' load of bucket k.
The sender commits with `update_weight_version` as for every transport.

The buffer lives on the source rank's GPU, so every engine's ranks must see that GPU: SGLang
resolves the IPC handle by device UUID and its scheduler dies on a GPU it cannot see ("Invalid
device_uuid", `sglang/srt/utils/patch_torch.py`). The RL config therefore allows cuda_ipc with
one colocated engine only (engines on other GPUs use `broadcast`).

Requirements: CUDA (asking for this transport without it raises ValueError). Where sglang is
importable the payload is built with SGLang's own serializer and metadata class (its device named
by UUID); without it, `sync.flattened_payload` writes the same payload (CUDA-IPC handles, SGLang's
metadata name), which the embedded engine's `/update_weights_from_tensor` reads (the GPU check
runs that path without SGLang). Engines must implement
`sync.engine_api.ColocatedEngineEndpoint`. Memory on the source rank: 2 x bucket_bytes of GPU
memory (plus a tensor larger than a bucket, shared from its own memory); no checksum (the bytes
never leave the GPU's memory).
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib.util
from typing import Iterable

import torch

from sync.bucket import Bucket, BucketPacker
from sync.engine_api import ColocatedEngineEndpoint
from sync.engine_set import EngineSet, SyncError, describe
from sync.flattened_payload import FlattenedTensorMetadata, serialize
from sync.transports.base import Transport, exhaust


def missing_requirements() -> list[str]:
    missing = []
    if not torch.cuda.is_available():
        missing.append("CUDA (torch.cuda.is_available() is False: no GPU or a CPU-only torch)")
    return missing


def _with_sglang() -> bool:
    return importlib.util.find_spec("sglang") is not None


class CudaIpcTransport(Transport):
    name = "cuda_ipc"
    session = True

    def __init__(self, config):
        super().__init__(config)
        if missing := missing_requirements():
            raise ValueError(
                f"transport 'cuda_ipc' needs {' and '.join(missing)}; on a machine without them "
                f"use transport 'broadcast' or 'disk'"
            )
        self.packer: BucketPacker | None = None
        self._worker: cf.ThreadPoolExecutor | None = None
        self.ranks: dict[str, int] = {}  # engine -> its TP ranks (one payload each)

    def open(self, engines: EngineSet) -> None:
        for engine in engines.engines:
            if not isinstance(engine, ColocatedEngineEndpoint):
                raise ValueError(
                    f"engines: {engine.name} has no update_weights_from_tensor; the cuda_ipc "
                    f"transport needs sync.engine_api.ColocatedEngineEndpoint"
                )
        self.ranks = engines.results(lambda e: e.num_group_ranks(), "server_info")
        if _with_sglang():  # SGLang resolves the IPC handle's GPU by UUID
            # optional: SGLang (GPU engines only)
            from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

            monkey_patch_torch_reductions()
        self.packer = BucketPacker(self.config.bucket_bytes, torch.device("cuda", torch.cuda.current_device()))
        self._worker = cf.ThreadPoolExecutor(1, thread_name_prefix="sync-cuda-ipc")
        self.broken = False

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, engines: EngineSet) -> int:
        """Source rank only; returns the bytes handed over. Raises SyncError after exhausting the export."""
        stream = iter(named_tensors)
        sent_bytes, pending = 0, None
        try:
            for bucket in self.packer.pack(stream):
                torch.cuda.current_stream().synchronize()  # the packed bytes are in memory
                if pending is not None:
                    sent_bytes += pending.result()
                pending = self._worker.submit(self._hand_over, bucket, version, engines)
            if pending is not None:
                sent_bytes += pending.result()
        except BaseException:
            if pending is not None:
                cf.wait([pending])
            exhaust(stream)  # the export's collectives stay in lockstep with the other ranks
            raise
        return sent_bytes

    def _hand_over(self, bucket: Bucket, version: int, engines: EngineSet) -> int:
        payloads = {e.name: serialize_bucket(bucket, self.ranks[e.name]) for e in engines.engines}
        failed = engines.call(  # no weight_version: the sender commits it last (sync.engine_api)
            lambda e: e.update_weights_from_tensor(
                serialized_named_tensors=payloads[e.name],
                load_format="flattened_bucket",
                weight_version=None,
            )
        )
        if failed:
            engine = next(iter(failed))
            raise SyncError(
                f"bucket {bucket.index} ({len(bucket.metas)} tensors, first {bucket.metas[0].name}) of "
                f"version {version} failed on {engine}: {describe(failed)}",
                engine=engine,
                bucket=bucket.index,
            )
        return bucket.nbytes

    def close(self, engines: EngineSet) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
        self.packer, self._worker, self.broken = None, None, True


def serialize_bucket(bucket: Bucket, num_ranks: int) -> list[str]:
    """SGLang's flattened-bucket payload for one bucket, serialized once per engine TP rank: with
    SGLang's own classes where it is installed, else with `sync.flattened_payload`'s."""
    if _with_sglang():
        # optional: SGLang (GPU engines only)
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata as Metadata

        def dump(payload: dict) -> str:
            return MultiprocessingSerializer.serialize(payload, output_str=True)
    else:
        Metadata = FlattenedTensorMetadata

        def dump(payload: dict) -> str:
            return serialize(payload, share=True)

    metadata = [
        Metadata(
            name=m.name,
            shape=torch.Size(m.shape),
            dtype=m.dtype,
            start_idx=m.offset,
            end_idx=m.offset + m.nbytes,
            numel=m.nbytes,
        )
        for m in bucket.metas
    ]
    payload = {"flattened_tensor": bucket.data, "metadata": metadata}
    return [dump(payload) for _ in range(num_ranks)]
