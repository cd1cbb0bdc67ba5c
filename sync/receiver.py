"""Engine side of the weight sync: join the group, receive buckets, stage, commit atomically.

The embedded engine's HTTP server drives one `WeightReceiver` per engine process, one call per
SGLang route (see `sync.engine_api` for the whole sequence):

    receiver = WeightReceiver(device="cpu")
    /init_weights_update_group    -> receiver.join(master_address, master_port, rank_offset,
                                                   world_size, group_name, backend, timeout_s)
    /begin_weight_update          -> receiver.begin()   (a new version starts staging)
    /update_weights_from_distributed -> receiver.receive_bucket(names, dtypes, shapes,
                                                   weight_version, checksum, group_name)
    /update_weights_from_tensor   -> receiver.stage_tensors(decoded payload, weight_version)
    /update_weights_from_disk     -> receiver.stage_from_disk(model_path, weight_version) (an anchor,
                                     or a delta chain on storage: `sync.published`)
    /update_weight_version        -> tensors = receiver.commit(new_version); load them into
                                     the model under the lock that guards generation
    /continue_generation          -> receiver.abort()   (drops an uncommitted version, if any)
    /destroy_weights_update_group -> receiver.leave(group_name)

Groups: an engine may belong to several weight-update groups at once, kept by `group_name` as
SGLang keeps them (one per pipeline stage of the trainer, `sync.stages`); each bucket names the
group it arrives on. Bucket indices (the checksum tags) run across the groups of one version.

Versions are integers sent as decimal strings (SGLang's `weight_version` is a string). Buckets
normally carry none (the sender names the version only at the commit, see `sync.engine_api`);
one that does must name a version above the committed one, else ValueError before any
collective. A commit of a version that is not above the committed one is refused, except the
first commit after joining a group: a new sync source (a trainer restarted from an older run
checkpoint while the engine kept running) rolls the engine back to its version.

Storage (why a sync runs at wire speed): the receiver keeps two sets of weight storage, one
holding the served version and one the version being staged, and swaps them at commit. A set
is a few flat uint8 segments, one per bucket layout (names, dtypes, shapes); a bucket is
broadcast straight into its segment (no per-bucket allocation, no copy) and the staged
tensors are views of it. Segments are allocated by the first two versions and reused by every
later one (a layout no longer sent is freed at the next commit of that set).
Memory cost: 2 x the bytes of a version (served + staged), the same bound as a fresh copy per
version but without page faults and allocator churn. `commit` returns views of the served
set; they stay valid until the version after next is staged into the same set, so an engine
must load them into its model (copy) or stop using them by then.

Concurrency: `receive_bucket` may be called from several threads at once (an HTTP server with a
thread per request; the sender keeps two buckets in flight). Collectives run one at a time in
bucket order: the sender tags each checksum with the bucket's index in the version
("crc32:XXXXXXXX#k"), and an untagged call takes the next index on arrival (SGLang-style
serial callers). The checksum of bucket k runs after its collective, outside that order, so it
overlaps the receive of bucket k+1. A bucket's call returns (the ack) once it is verified.
A checksum mismatch rejects the version: that bucket's call raises, and so does every later
bucket's call that finishes after it; an earlier bucket acks whenever its checksum finishes
(its own bytes verified), so a sender reading acks in bucket order names the corrupted one.

Deltas (`sync.delta`, announced with load_format `DELTA_LOAD_FORMAT`): a bucket's tensors are
payloads, each naming the version it applies on. The receiver keeps the served version's tensors
(`applied`, an `AppliedCopy` of views of the served set: no copy) and writes each tensor of the
delta into the staging set (the held bytes, then the payload's changed elements), each checked
by its hash; the payload bytes themselves land in a buffer of their own. A payload on another
base, a failed hash, or two payloads of one tensor reject the version as a failed checksum does;
a commit whose delta did not cover every held tensor (a lost bucket) or produces another version
is refused. The served version is never touched: the sender then sends a full version (an anchor).

A failed collective leaves the group unusable: the receiver drops what it staged, leaves the
group and re-raises; the sender then forms a new group with the engines still alive.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from sync import published
from sync.bucket import TensorMeta, layout, unpack
from sync.bucket import checksum as bucket_checksum
from sync.delta import AppliedCopy, DeltaError, check_complete, header
from sync.group import WeightUpdateGroup

_Key = tuple  # a bucket layout: ((name, dtype, shape), ...)


class WeightReceiver:
    def __init__(self, device: torch.device | str = "cpu", version: int = 0):
        self.device = torch.device(device)
        self.version = version  # the committed (served) weight version
        self.groups: dict[str, WeightUpdateGroup] = {}  # by group_name, in join order
        self._sets: list[dict[_Key, torch.Tensor]] = [{}, {}]  # storage: served, staging
        self._staging = 1  # index of the set being staged into
        self._used: set[_Key] = set()  # segments the staged version wrote
        self._staged: dict[str, torch.Tensor] = {}
        self.applied = AppliedCopy()  # the served version's tensors, what a delta applies on
        self._staging_open = False  # buckets of a new version are being received
        self._labelled: int | None = None  # the version the staged buckets named, if they did
        self._rejected: int | None = None  # the first bucket that failed its checksum: no commit
        self._rejoined = False  # a group was joined since the last commit: the next may go back
        self._state = threading.RLock()
        self._turn = threading.Condition(self._state)  # orders collectives by bucket index
        self._tickets = 0  # buckets of the staged version announced so far
        self._buckets = 0  # buckets of the staged version whose collective ran

    # -- group lifecycle -------------------------------------------------------------------
    def join(
        self,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "gloo",
        timeout_s: float = 300.0,
    ) -> None:
        """Join the weight-update group `group_name` as `rank` (blocks until every rank joined)."""
        if group_name in self.groups:
            raise RuntimeError(f"already in group {group_name!r}; call leave({group_name!r}) before joining it again")
        self.groups[group_name] = WeightUpdateGroup.join(
            master_address, master_port, rank, world_size, group_name, backend, timeout_s
        )
        self._rejoined = True

    @property
    def group(self) -> WeightUpdateGroup | None:
        """The group joined last (the only one without pipeline stages), None if none."""
        return next(reversed(self.groups.values()), None)

    def leave(self, group_name: str | None = None) -> None:
        """Leave `group_name`, or every group (local, idempotent); staged data of an unfinished
        version is dropped."""
        self.abort()
        for name in [group_name] if group_name is not None else list(self.groups):
            group = self.groups.pop(name, None)
            if group is not None:
                group.destroy()

    # -- one version ---------------------------------------------------------------------
    def begin(self) -> None:
        """A new version starts: whatever an abandoned one staged is dropped."""
        with self._state:
            self._reset()
            self._staging_open = True

    def receive_bucket(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        weight_version: str | int | None = None,
        checksum: str | None = None,
        group_name: str | None = None,
        delta: bool = False,
    ) -> list[tuple[str, torch.Tensor]]:
        """Collective with the sender's broadcast of this bucket; returns the staged tensors.
        `delta`: the bucket holds delta payloads (load_format `sync.delta.DELTA_LOAD_FORMAT`).

        Raises ValueError for a stale version, bad metadata, a checksum mismatch or a delta that
        does not apply (the group stays usable; the version's staged data is dropped),
        RuntimeError for a failed collective.
        """
        if not self.groups:
            raise RuntimeError("receive_bucket before join(): call /init_weights_update_group first")
        if group_name is None and len(self.groups) == 1:
            group_name = next(iter(self.groups))
        if group_name not in self.groups:
            raise ValueError(f"group_name: {group_name!r} is not a joined group ({sorted(self.groups)})")
        metas = layout(names, dtypes, shapes)
        checksum, index = _split_tag(checksum)
        with self._state:
            version = self._begin(weight_version)
            if index is None:  # untagged: arrival order
                index = self._tickets
            self._tickets += 1
            if not self._turn.wait_for(lambda: self._buckets == index, self._timeout_s()):
                raise RuntimeError(
                    f"version {version}: bucket {index} waited for bucket {self._buckets} "
                    f"until the timeout; was it announced?"
                )
        failure = None
        try:
            with self._state:
                group = self.groups.get(group_name)  # None if an earlier bucket's collective failed meanwhile
                if group is not None:  # a delta's payloads are not kept: a buffer of their own
                    nbytes = sum(m.nbytes for m in metas)
                    data = torch.empty(nbytes, dtype=torch.uint8) if delta else self._segment(metas)
                    bucket = index
            if group is not None:
                group.broadcast(data, src=0)
        except Exception as error:  # noqa: BLE001 - re-raised below, after the turn passed on
            failure = error
        finally:
            with self._state:
                self._buckets += 1
                self._turn.notify_all()
        if group is None:
            raise RuntimeError(f"version {version}: the group was left after a failed receive")
        if failure is not None:
            self.leave()
            raise RuntimeError(f"bucket {bucket} of version {version}: receive failed: {failure}") from failure
        # Outside the turn: this checksum overlaps the next bucket's receive.
        if checksum is not None and (got := bucket_checksum(data)) != checksum:
            with self._state:
                self._rejected = bucket if self._rejected is None else min(self._rejected, bucket)
            raise ValueError(
                f"bucket {bucket} of version {version}: checksum mismatch (announced {checksum}, "
                f"received {got}); bucket rejected, still serving version {self.version}"
            )
        try:
            received = self._decode(unpack(data, metas)) if delta else unpack(data, metas)
        except DeltaError as error:
            with self._state:
                self._rejected = bucket if self._rejected is None else min(self._rejected, bucket)
            raise ValueError(f"bucket {bucket} of version {version}: {error}; still serving {self.version}") from None
        tensors = [(name, t.to(self.device)) for name, t in received]
        with self._state:
            if not self._staging_open:
                raise ValueError(f"version {version} was dropped (aborted); resend it")
            if self._rejected is not None and self._rejected < bucket:
                raise ValueError(
                    f"version {version} was dropped (bucket {self._rejected} failed its checksum); resend it"
                )
            if self._rejected is None:
                self._staged.update(tensors)
        return tensors

    def stage_tensors(self, tensors: dict[str, torch.Tensor], weight_version: str | int | None = None) -> list[str]:
        """Stage copies of `tensors`: a bucket handed over in memory (`/update_weights_from_tensor`,
        CUDA-IPC views of the sender's buffer, which it packs again once this returns)."""
        with self._state:
            self._begin(weight_version)
            self._staged.update((name, t.to(self.device, copy=True)) for name, t in tensors.items())
            return sorted(tensors)

    def stage_from_disk(self, model_path: str | Path, weight_version: str | int) -> list[str]:
        """Stage the version published in `model_path` (`sync.published`: an anchor's safetensors
        files, or a delta resolved from the served version or the last anchor, every hash checked);
        returns the names. ValueError if it cannot be resolved or is not `weight_version`."""
        tensors, version = published.resolve(Path(model_path), self.applied)
        if version is not None and version != _parse_version(weight_version):
            raise ValueError(f"model_path: {model_path} publishes version {version}, not {weight_version}")
        with self._state:
            self._begin(weight_version)  # copies: a resolved tensor may be one the served set holds
            self._staged.update((name, t.to(self.device, copy=True)) for name, t in tensors.items())
            return sorted(self._staged)

    def loaded(self, tensors: dict[str, torch.Tensor], version: int | None) -> None:
        """The engine serves `tensors` at `version`, loaded outside the buckets (a disk load): the
        served version and the copy deltas apply on follow (None: an unversioned load, after which
        deltas are refused until an anchor)."""
        with self._state:
            if version is not None:
                self.version = max(self.version, version)
            self.applied.hold(tensors, version)

    def snapshot(self) -> tuple[int, dict[str, torch.Tensor]]:
        """The served version and a host copy of its tensors (`sync.peer_feed`). ValueError if this
        receiver holds no copy of what it serves (it serves its starting checkpoint, or an
        unversioned load)."""
        with self._state:
            if self.applied.version is None or self.applied.version != self.version:
                raise ValueError(
                    f"this engine holds no copy of the version it serves ({self.version}): it received "
                    "none since it started; feed joiners from the trainer or from another engine"
                )
            return self.version, {name: t.to("cpu", copy=True) for name, t in self.applied.tensors.items()}

    @property
    def may_go_back(self) -> bool:
        """The next commit may be of an older version than the served one: the first after a group
        was joined (a new sync source: see the module docstring)."""
        return self._rejoined

    @property
    def labelled_version(self) -> int | None:
        """The version the staged buckets named (None: they named none, the commit names it)."""
        return self._labelled

    @property
    def staged(self) -> bool:
        """True while a received version waits for its commit."""
        return self._staging_open and bool(self._staged)

    def commit(self, weight_version: str | int) -> dict[str, torch.Tensor]:
        """Make the staged version the served one; returns its tensors (by HF name, views of
        the served storage: see the module docstring for how long they stay valid)."""
        version = _parse_version(weight_version)
        with self._state:
            if version <= self.version and not self.may_go_back:
                raise ValueError(f"new_version: {version} is stale or repeated (serving {self.version})")
            if not self.staged or self._rejected is not None or self._labelled not in (None, version):
                raise RuntimeError(
                    f"commit of version {version}, but "
                    + (
                        f"the staged version was rejected (bucket {self._rejected} failed its checksum)"
                        if self._rejected is not None
                        else f"the staged buckets are of version {self._labelled}"
                        if self.staged
                        else "nothing is staged"
                    )
                )
            if self.applied.produced:  # a delta: every held tensor, all at the committed version
                check_complete(self._staged, self.applied.tensors, self.applied.produced | {version})
            staging = self._sets[self._staging]
            for key in set(staging) - self._used:  # layouts this version did not use
                del staging[key]
            tensors = self._staged
            self.applied.hold(tensors, version)
            self._staging = 1 - self._staging  # the old served set takes the next version
            self.version, self._rejoined = version, False
            self._reset()
            return tensors

    def abort(self) -> None:
        """Drop an uncommitted staged version (the engine keeps serving `self.version`)."""
        with self._state:
            self._reset()

    def _reset(self) -> None:
        self._staged, self._staging_open, self._labelled = {}, False, None
        self.applied.discard()
        self._rejected, self._used = None, set()
        self._tickets = self._buckets = 0

    def _begin(self, weight_version: str | int | None) -> int | str:
        """Checks a bucket's version (if it names one); returns how errors should name it."""
        if weight_version is not None:
            version = _parse_version(weight_version)
            if version <= self.version and not self.may_go_back:
                raise ValueError(
                    f"weight_version: {version} is stale or repeated (serving {self.version}); versions must increase"
                )
            if self._labelled not in (None, version):  # another version: forget the abandoned one
                self._reset()
            self._labelled = version
        self._staging_open = True
        return self._labelled if self._labelled is not None else "being staged"

    def _timeout_s(self) -> float:
        group = self.group
        return group.timeout.total_seconds() if group is not None else 0.0

    def _segment(self, metas: list[TensorMeta], nbytes: int | None = None) -> torch.Tensor:
        """The staging set's storage for this bucket layout (allocated on first use); `nbytes`:
        the layout's length where it is not the packed one."""
        key = tuple((m.name, m.dtype, m.shape) for m in metas)
        storage = self._sets[self._staging]
        if key not in storage:
            nbytes = sum(m.nbytes for m in metas) if nbytes is None else nbytes
            storage[key] = torch.empty(nbytes, dtype=torch.uint8, device=self.group.device)  # all groups: one device
        self._used.add(key)
        return storage[key]

    def _decode(self, payloads: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """A delta bucket's tensors, each written into the staging set (outside the collective
        turn, like a checksum). DeltaError if a payload does not apply or names a tensor twice
        (`AppliedCopy.stage`)."""
        heads = [header(payload) for _, payload in payloads]
        metas, offset = [], 0
        for (name, _), head in zip(payloads, heads):  # each tensor aligned (any dtype after any)
            offset = -(-offset // 8) * 8
            metas.append(TensorMeta(name, head.dtype, head.shape, offset))
            offset += metas[-1].nbytes
        with self._state:
            storage = self._segment(metas, nbytes=offset)
        decoded = []
        for (name, payload), meta in zip(payloads, metas):
            out = storage[meta.offset : meta.offset + meta.nbytes].view(meta.dtype).view(meta.shape)
            decoded.append((name, self.applied.stage(name, payload, out)[0]))
        return decoded


def _split_tag(tag: str | None) -> tuple[str | None, int | None]:
    """ "crc32:XXXXXXXX#k" -> ("crc32:XXXXXXXX", k); a plain checksum has no bucket index."""
    if tag is None or "#" not in tag:
        return tag, None
    checksum, index = tag.rsplit("#", 1)
    if not index.isdigit():
        raise ValueError(f"checksum: {tag!r} should be 'crc32:XXXXXXXX#<bucket index>'")
    return checksum, int(index)


def _parse_version(weight_version: str | int) -> int:
    try:
        return int(weight_version)
    except (TypeError, ValueError):
        raise ValueError(f"weight_version: {weight_version!r} is not an integer") from None
