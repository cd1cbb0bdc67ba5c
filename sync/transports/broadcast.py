"""Process-group broadcast transport (gloo on CPU, NCCL on GPU): SGLang's distributed update.

Group ranks: this root 0, its relays 1..R (`sync.relay`, trainer ranks on the root's node, when
`relays` is set), then each engine's TP ranks from its rank_offset.

Per bucket, on the trainer source rank (group rank 0):
  - announce it to every engine (`update_weights_from_distributed`, load_format
    "flattened_bucket", or `sync.delta.DELTA_LOAD_FORMAT` for a bucket of delta payloads;
    names/dtypes/shapes, checksum; no weight_version: the sender commits the version once every
    bucket arrived, see `sync.engine_api`) on the engine loop,
  - broadcast its flat buffer over the weight-update group, concurrently with the announce,
  - announce bucket k+1 only once the broadcast of bucket k completed (so each engine sees
    bucket k's collective before bucket k+1's), and wait for every engine's ack of bucket k
    (received and checksum verified) before bucket k+2: the engines' check of k overlaps the
    transfer of k+1.
Packing bucket k+1 (the export's gathers + copy + checksum, on the calling thread) overlaps
sending bucket k (on one worker thread): double buffering.

Memory on the source rank: 2 x bucket_bytes (allocated once at `open`, reused every step)
plus any tensor larger than a bucket (sent from its own memory, no copy).
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections import deque
from typing import Iterable

import torch

from sync.bucket import Bucket, BucketPacker
from sync.delta import DELTA_LOAD_FORMAT
from sync.engine_set import EngineSet, SyncError, describe
from sync.group import WeightUpdateGroup, client_store, host_store
from sync.transports.base import Transport, exhaust

_POLL_S = 0.002  # how often a running broadcast looks for engines that failed meanwhile
_ABORT_GRACE_S = 2.0  # how long an aborted rendezvous (a broadcast with a failed engine) waits


def _completes(work, within_s: float) -> bool:
    """True if the collective `work` completes within `within_s` seconds."""
    deadline = time.monotonic() + within_s
    while not work.is_completed():
        if time.monotonic() > deadline:
            return False
        time.sleep(_POLL_S)
    return True


class BroadcastTransport(Transport):
    name = "broadcast"
    session = True
    carries_deltas = True

    def __init__(self, config):
        super().__init__(config)
        self.group: WeightUpdateGroup | None = None
        self._store = None  # the hosted rendezvous store (rank 0's server), kept with the group
        self.packer: BucketPacker | None = None
        self._worker: cf.ThreadPoolExecutor | None = None
        self.relays = None  # a sync.relay.RelayLink: trainer ranks 1..R of the group, behind this root
        self.first_index = 0  # the index of this send's first bucket in the version (stages: `sync.stages`)
        self.buckets_sent = 0  # buckets of the last send

    def open(self, engines: EngineSet) -> None:
        """Form the group: rank 0 here, each engine's TP ranks from its rank_offset (SGLang's layout).

        Each engine says how many ranks it brings (`/server_info` tp_size). Rank 0's rendezvous
        runs on the worker thread while this thread watches the engines' joins: when one fails
        (the engine died, or refused), the rendezvous is aborted at once by dropping the hosted
        store, so no rank waits out `timeout_s` for a dead member, and SyncError names the
        engine. After any failure every engine is told to leave the group (SGLang keeps a group
        name taken until then, and every later join under that name would fail)."""
        cfg = self.config
        ranks = engines.results(lambda e: e.num_group_ranks(), "server_info")
        relays = len(self.relays) if self.relays is not None else 0
        world_size = 1 + relays + sum(ranks.values())
        self._store = host_store(cfg.address, world_size, cfg.timeout_s, cfg.master_port)
        port = self._store.port
        if relays:  # they join on their own threads, as the engines do
            self.relays.join(cfg.address, port, world_size, cfg.group_name, cfg.backend, cfg.timeout_s)
        offsets, offset = {}, 1 + relays
        for engine in engines.engines:
            offsets[engine.name], offset = offset, offset + ranks[engine.name]
        joins = engines.submit(
            lambda e: e.init_weights_update_group(
                cfg.address, port, offsets[e.name], world_size, cfg.group_name, cfg.backend
            )
        )
        self._worker = cf.ThreadPoolExecutor(1, thread_name_prefix="sync-broadcast")
        store = client_store(cfg.address, port, world_size, cfg.timeout_s)
        joined = self._worker.submit(
            WeightUpdateGroup.join,
            cfg.address,
            port,
            0,
            world_size,
            cfg.group_name,
            cfg.backend,
            cfg.timeout_s,
            store=store,
        )
        del store  # the group holds it; the transport holds the only reference to the server
        while not joined.done():
            done, _ = cf.wait(joins.values(), timeout=_POLL_S * 10, return_when=cf.FIRST_EXCEPTION)
            if any(f.exception() is not None for f in done):
                self._store = None  # abort the rendezvous: every rank blocked in it fails fast
                break
        if self._store is None:
            # Aborted: live engines notice at once, or when their store client gives up
            # connecting (up to timeout_s); leave those joins behind rather than wait for them.
            cf.wait(joins.values(), timeout=_ABORT_GRACE_S)
            failed = {
                name: f.exception()
                for name, f in joins.items()
                if f.done() and not f.cancelled() and f.exception() is not None
            }
            for future in joins.values():
                future.cancel()
        else:
            failed = engines.wait(joins)
        error = joined.exception()
        if error is not None or failed:
            if error is None:
                joined.result().destroy()
            engines.call(lambda e: e.destroy_weights_update_group(cfg.group_name))  # best effort
            self.close(engines)
            raise SyncError(
                f"weight-update group did not form: {error or 'an engine failed to join'}; {describe(failed)}",
                engine=next(iter(failed), None),
            )
        self.group = joined.result()
        # no hash (and no host copy) unless an engine of the group checks it
        self.packer = BucketPacker(
            cfg.bucket_bytes, self.group.device, checksums=any(e.verifies_checksums for e in engines.engines)
        )
        self.broken = False

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, engines: EngineSet) -> int:
        """Source rank only; returns the bytes sent. Raises SyncError after exhausting the export.

        At most two buckets are unacknowledged: bucket k+1 is announced and broadcast once the
        broadcast of k completed, while the engines still verify k (its checksum overlaps the
        transfer of k+1); the acks of k are awaited before bucket k+2 starts.
        """
        stream = iter(named_tensors)
        sent_bytes, pending, unacked = 0, None, deque()
        self.buckets_sent = 0
        try:
            for bucket in self.packer.pack(stream):
                bucket.index += self.first_index
                self.buckets_sent += 1
                if pending is not None:
                    unacked.append(pending.result())  # broadcast k-1 done: its buffer is free
                    pending = None
                while len(unacked) > 1:
                    sent_bytes += self._acknowledged(*unacked.popleft(), version, engines)
                pending = self._worker.submit(self._broadcast, bucket, version, engines)
            if pending is not None:
                unacked.append(pending.result())
                pending = None
            while unacked:
                sent_bytes += self._acknowledged(*unacked.popleft(), version, engines)
        except BaseException:
            # Every announced bucket finishes its collective and its acks before we report,
            # so the group stays in lockstep (and usable when only a checksum failed).
            if pending is not None:
                cf.wait([pending])
                if pending.exception() is None:
                    unacked.append(pending.result())
            for bucket_id, acks in unacked:
                engines.wait(acks)
            exhaust(stream)  # the export's collectives stay in lockstep with the other ranks
            raise
        return sent_bytes

    def _broadcast(self, bucket: Bucket, version: int, engines: EngineSet) -> tuple[tuple, dict]:
        """Worker thread: announce bucket k to every engine and broadcast it; returns its acks."""
        fields = bucket.announcement()
        bucket_id = (bucket.index, len(bucket.metas), bucket.nbytes, bucket.metas[0].name)
        acks = engines.submit(
            lambda e: e.update_weights_from_distributed(
                **fields,
                group_name=self.config.group_name,
                weight_version=None,
                load_format=DELTA_LOAD_FORMAT if self.delta else "flattened_bucket",
                checksum=None if bucket.checksum is None else f"{bucket.checksum}#{bucket.index}",
            )
        )
        if self.relays is not None:
            self.relays.bucket(bucket.nbytes)
        work = self.group.broadcast_async(bucket.data)
        try:
            # An engine that fails before joining the collective would leave the broadcast
            # hanging until the timeout: watch the acks, and tear the group down soon after one
            # fails. Not at once: an engine may answer right after its side of the collective
            # (e.g. refusing a version an earlier bucket's checksum dropped) before our side
            # reports completion; then the group is fine and the acks report the refusal.
            while not work.is_completed():
                done, _ = cf.wait(acks.values(), timeout=_POLL_S, return_when=cf.FIRST_EXCEPTION)
                if any(f.exception() is not None for f in done) and not _completes(work, _ABORT_GRACE_S):
                    raise RuntimeError("an engine failed during the broadcast")
            self.group.wait(work)
        except Exception as error:  # the group is unusable now: peers blocked on it fail fast
            self.broken = True
            self.group.destroy()
            self._acknowledged(bucket_id, acks, version, engines, broadcast_error=error)
        return bucket_id, acks

    def _acknowledged(
        self, bucket_id: tuple, acks: dict, version: int, engines: EngineSet, broadcast_error: Exception | None = None
    ) -> int:
        """Wait for one bucket's acks; raise SyncError naming the engine and bucket if any failed."""
        index, count, nbytes, first = bucket_id
        failed = engines.wait(acks)
        if failed or broadcast_error:
            engine = next(iter(failed), None)
            detail = describe(failed) if failed else f"broadcast: {broadcast_error}"
            raise SyncError(
                f"bucket {index} ({count} tensors, {nbytes} bytes, first {first}) of version "
                f"{version} failed on {engine or 'the broadcast'}: {detail}",
                engine=engine,
                bucket=index,
            )
        return nbytes

    def close(self, engines: EngineSet) -> None:
        """Engines leave the group (best effort: a dead one cannot), then this rank."""
        if self.group is not None:
            engines.call(lambda e: e.destroy_weights_update_group(self.config.group_name))
            if self.relays is not None:
                self.relays.leave()
            self.group.destroy()
            self.group = None
        if self._worker is not None:
            self._worker.shutdown(wait=True)
        self.packer, self._worker, self._store, self.broken = None, None, None, True
