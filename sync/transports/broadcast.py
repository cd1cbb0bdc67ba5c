"""Process-group broadcast transport (gloo on CPU, NCCL on GPU): SGLang's distributed update.

Per bucket, on the trainer source rank (group rank 0):
  - announce it to every engine (`update_weights_from_distributed`, load_format
    "flattened_bucket", names/dtypes/shapes, weight_version, checksum) on the engine loop,
  - broadcast its flat buffer over the weight-update group, concurrently with the announce,
  - wait for every engine's ack (the announce call returning) before announcing the next one,
    so each engine sees bucket k's collective before bucket k+1's.
Packing bucket k+1 (the export's gathers + copy + checksum, on the calling thread) overlaps
sending bucket k (on one worker thread): double buffering.

Memory on the source rank: 2 x bucket_bytes (allocated once at `open`, reused every step)
plus any tensor larger than a bucket (sent from its own memory, no copy).
"""

from __future__ import annotations

import concurrent.futures as cf
from typing import Iterable

import torch

from sync.bucket import Bucket, BucketPacker
from sync.engine_set import EngineSet, SyncError, describe
from sync.group import WeightUpdateGroup, host_store
from sync.transports.base import Transport

_POLL_S = 0.002  # how often a running broadcast looks for engines that failed meanwhile


class BroadcastTransport(Transport):
    name = "broadcast"

    def __init__(self, config):
        super().__init__(config)
        self.group: WeightUpdateGroup | None = None
        self.packer: BucketPacker | None = None
        self._worker: cf.ThreadPoolExecutor | None = None

    def open(self, engines: EngineSet) -> None:
        """Form the group: rank 0 here, each engine from its rank_offset (SGLang's layout)."""
        cfg = self.config
        world_size = 1 + sum(e.num_group_ranks for e in engines.engines)
        store = host_store(cfg.master_address, world_size, cfg.timeout_s, cfg.master_port)
        offsets, offset = {}, 1
        for engine in engines.engines:
            offsets[engine.name], offset = offset, offset + engine.num_group_ranks
        joins = engines.submit(
            lambda e: e.init_weights_update_group(
                cfg.master_address, store.port, offsets[e.name], world_size, cfg.group_name, cfg.backend
            )
        )
        try:
            self.group = WeightUpdateGroup.join(
                cfg.master_address, store.port, 0, world_size, cfg.group_name, cfg.backend,
                cfg.timeout_s, store=store,
            )
        except Exception as error:
            failed = engines.wait(joins)
            raise SyncError(f"weight-update group did not form: {error}; {describe(failed)}",
                            engine=next(iter(failed), None)) from error
        if failed := engines.wait(joins):
            self.group.destroy()
            raise SyncError(f"init_weights_update_group failed: {describe(failed)}", engine=next(iter(failed)))
        self.packer = BucketPacker(cfg.bucket_bytes, self.group.device)
        self._worker = cf.ThreadPoolExecutor(1, thread_name_prefix="sync-broadcast")
        self.broken = False

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, engines: EngineSet) -> int:
        """Source rank only; returns the bytes sent. Raises SyncError after draining the export."""
        stream = iter(named_tensors)
        sent_bytes, pending = 0, None
        try:
            for bucket in self.packer.pack(stream):
                if pending is not None:
                    sent_bytes += pending.result()
                pending = self._worker.submit(self._send_bucket, bucket, version, engines)
            if pending is not None:
                sent_bytes += pending.result()
        except BaseException:
            if pending is not None:
                cf.wait([pending])
            for _ in stream:  # keep the export's collectives in lockstep with the other ranks
                pass
            raise
        return sent_bytes

    def _send_bucket(self, bucket: Bucket, version: int, engines: EngineSet) -> int:
        fields = bucket.announcement()
        acks = engines.submit(
            lambda e: e.update_weights_from_distributed(
                **fields, group_name=self.config.group_name, weight_version=str(version),
                load_format="flattened_bucket", checksum=bucket.checksum,
            )
        )
        work = self.group.broadcast_async(bucket.data)
        broadcast_error = None
        try:
            # An engine that fails before joining the collective would leave the broadcast
            # hanging until the timeout: watch the acks, and tear the group down at once.
            while not work.is_completed():
                done, _ = cf.wait(acks.values(), timeout=_POLL_S, return_when=cf.FIRST_EXCEPTION)
                if any(f.exception() is not None for f in done):
                    raise RuntimeError("an engine failed during the broadcast")
            self.group.wait(work)
        except Exception as error:  # the group is unusable now: peers blocked on it fail fast
            broadcast_error = error
            self.broken = True
            self.group.destroy()
        failed = engines.wait(acks)
        if failed or broadcast_error:
            engine = next(iter(failed), None)
            detail = describe(failed) if failed else f"broadcast: {broadcast_error}"
            raise SyncError(
                f"bucket {bucket.index} ({len(bucket.metas)} tensors, {bucket.nbytes} bytes, first "
                f"{bucket.metas[0].name}) of version {version} failed on "
                f"{engine or 'the broadcast'}: {detail}",
                engine=engine, bucket=bucket.index,
            )
        return bucket.nbytes

    def close(self, engines: EngineSet) -> None:
        """Engines leave the group (best effort: a dead one cannot), then this rank."""
        if self.group is not None:
            engines.call(lambda e: e.destroy_weights_update_group(self.config.group_name))
            self.group.destroy()
            self.group = None
        if self._worker is not None:
            self._worker.shutdown(wait=True)
        self.packer, self._worker, self.broken = None, None, True
