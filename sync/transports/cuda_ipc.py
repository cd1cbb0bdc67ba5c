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

Delta sync (`sync.delta`) into SGLang takes this route, the only one on which SGLang 0.5.23 runs a
custom loader: when every engine registered `sync.delta.SGLANG_LOADER` (`--custom-weight-loader`,
which the launcher adds with `sync.delta.enabled`), each bucket goes as named `sync.delta` payloads
(`loader_payloads`: the stream's payloads for a delta, each tensor as a dense SUM64 payload for an
anchor) with that `load_format`, and the version ends with `sync.delta.SGLANG_COMMIT` and an empty
call, which answers any refusal (`moe_rl.engine.sglang_delta`).

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
from sync.delta import SGLANG_COMMIT, SGLANG_LOADER, SUM64, encode
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
    carries_deltas = True  # to engines that load with SGLANG_LOADER (`takes_deltas`)

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
        self.loader = False  # every engine loads with SGLANG_LOADER: every version goes as payloads

    def open(self, engines: EngineSet) -> None:
        for engine in engines.engines:
            if not isinstance(engine, ColocatedEngineEndpoint):
                raise ValueError(
                    f"engines: {engine.name} has no update_weights_from_tensor; the cuda_ipc "
                    f"transport needs sync.engine_api.ColocatedEngineEndpoint"
                )
        self.ranks = engines.results(lambda e: e.num_group_ranks(), "server_info")
        loaders = engines.results(lambda e: e.custom_weight_loaders(), "server_info")
        self.loader = bool(loaders) and all(SGLANG_LOADER in names for names in loaders.values())
        if _with_sglang():  # SGLang resolves the IPC handle's GPU by UUID
            # optional: SGLang (GPU engines only)
            from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

            monkey_patch_torch_reductions()
        self.packer = BucketPacker(self.config.bucket_bytes, torch.device("cuda", torch.cuda.current_device()))
        self._worker = cf.ThreadPoolExecutor(1, thread_name_prefix="sync-cuda-ipc")
        self.broken = False

    def takes_deltas(self, engines: EngineSet) -> bool:
        return self.loader

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
            if self.loader:
                self._commit(version, engines)
        except BaseException:
            if pending is not None:
                cf.wait([pending])
            exhaust(stream)  # the export's collectives stay in lockstep with the other ranks
            raise
        return sent_bytes

    def _hand_over(self, bucket: Bucket, version: int, engines: EngineSet) -> int:
        if self.loader:
            named = loader_payloads(bucket, version, self.delta)
            payloads = {e.name: serialize_named(named, self.ranks[e.name]) for e in engines.engines}
        else:
            payloads = {e.name: serialize_bucket(bucket, self.ranks[e.name]) for e in engines.engines}
        what = f"bucket {bucket.index} ({len(bucket.metas)} tensors, first {bucket.metas[0].name})"
        self._call(engines, payloads, f"{what} of version {version}", bucket.index)
        return bucket.nbytes

    def _commit(self, version: int, engines: EngineSet) -> None:
        """The loader's end of a version: every rank checks it holds `version` whole, then an empty
        call carries back any refusal (SGLang answers it before running the loader)."""
        marker = [(SGLANG_COMMIT, torch.tensor([version], device=self.packer.device))]
        for named, what in ((marker, "commit"), ([], "the refusal check")):
            payloads = {e.name: serialize_named(named, self.ranks[e.name]) for e in engines.engines}
            self._call(engines, payloads, f"{what} of version {version}", None)

    def _call(self, engines: EngineSet, payloads: dict[str, list[str]], what: str, bucket: int | None) -> None:
        failed = engines.call(  # no weight_version: the sender commits it last (sync.engine_api)
            lambda e: e.update_weights_from_tensor(
                serialized_named_tensors=payloads[e.name],
                load_format=SGLANG_LOADER if self.loader else "flattened_bucket",
                weight_version=None,
            )
        )
        if failed:
            engine = next(iter(failed))
            raise SyncError(f"{what} failed on {engine}: {describe(failed)}", engine=engine, bucket=bucket)

    def close(self, engines: EngineSet) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
        self.packer, self._worker, self.broken = None, None, True


def loader_payloads(bucket: Bucket, version: int, delta: bool) -> list[tuple[str, torch.Tensor]]:
    """A bucket as the delta loader takes it: a delta's payloads as they were packed (views of the
    bucket), an anchor's tensors each as a dense SUM64 payload of `version`."""
    named = []
    for meta in bucket.metas:
        data = bucket.data[meta.offset : meta.offset + meta.nbytes]
        if not delta:
            data = encode(data.view(meta.dtype).view(meta.shape), None, version, version, hash_kind=SUM64)
        named.append((meta.name, data))
    return named


def serialize_named(named: list[tuple[str, torch.Tensor]], num_ranks: int) -> list[str]:
    """Named tensors for `/update_weights_from_tensor`, once per engine TP rank, with SGLang's
    serializer (CUDA-IPC handles)."""
    # optional: SGLang (the delta loader runs in SGLang engines only)
    from sglang.srt.utils import MultiprocessingSerializer

    return [MultiprocessingSerializer.serialize(named, output_str=True) for _ in range(num_ranks)]


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
