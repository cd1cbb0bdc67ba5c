"""Engine side of the weight sync: join the group, receive buckets, stage, commit atomically.

The embedded engine's HTTP server drives one `WeightReceiver` per engine process, one call per
SGLang route (see `sync.engine_api` for the whole sequence):

    receiver = WeightReceiver(device="cpu")
    /init_weights_update_group    -> receiver.join(master_address, master_port, rank_offset,
                                                   world_size, group_name, backend, timeout_s)
    /update_weights_from_distributed -> receiver.receive_bucket(names, dtypes, shapes,
                                                   weight_version, checksum, group_name)
    /update_weights_from_disk     -> receiver.stage_from_disk(model_path, weight_version)
    /update_weight_version        -> tensors = receiver.commit(new_version); load them into
                                     the model under the lock that guards generation
    /continue_generation          -> receiver.abort()   (drops an uncommitted version, if any)
    /destroy_weights_update_group -> receiver.leave()

Versions are integers sent as decimal strings (SGLang's `weight_version` is a string). Only a
version above the committed one is accepted; a stale or repeated one raises ValueError before
any collective, so the server can answer `success: false` without touching the group.

Memory: staged tensors are copies (one received buffer per bucket) until commit: an engine
holds the served weights plus one staged version. A failed collective leaves the group
unusable: the receiver drops what it staged, leaves the group and re-raises; the sender then
forms a new group with the engines still alive.
"""

from __future__ import annotations

from pathlib import Path

import torch

from sync.bucket import checksum as bucket_checksum
from sync.bucket import layout, unpack
from sync.group import WeightUpdateGroup


class WeightReceiver:
    def __init__(self, device: torch.device | str = "cpu", version: int = 0):
        self.device = torch.device(device)
        self.version = version  # the committed (served) weight version
        self.group: WeightUpdateGroup | None = None
        self._staged: dict[str, torch.Tensor] = {}
        self._staged_version: int | None = None
        self._buckets_received = 0

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
        """Join the weight-update group as `rank` (blocks until every rank joined)."""
        if self.group is not None:
            raise RuntimeError(
                f"already in group {self.group.group_name!r}; call leave() before joining another"
            )
        self.group = WeightUpdateGroup.join(
            master_address, master_port, rank, world_size, group_name, backend, timeout_s
        )

    def leave(self) -> None:
        """Leave the group (local, idempotent); staged data of an unfinished version is dropped."""
        self.abort()
        if self.group is not None:
            group, self.group = self.group, None
            group.destroy()

    # -- one version ---------------------------------------------------------------------
    def receive_bucket(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        weight_version: str | int,
        checksum: str | None = None,
        group_name: str | None = None,
    ) -> list[tuple[str, torch.Tensor]]:
        """Collective with the sender's broadcast of this bucket; returns the staged tensors.

        Raises ValueError for a stale version, bad metadata or a checksum mismatch (the group
        stays usable; the version's staged data is dropped), RuntimeError for a failed collective.
        """
        if self.group is None:
            raise RuntimeError("receive_bucket before join(): call /init_weights_update_group first")
        if group_name is not None and group_name != self.group.group_name:
            raise ValueError(f"group_name: {group_name!r} is not the joined {self.group.group_name!r}")
        version = self._begin(weight_version)
        metas = layout(names, dtypes, shapes)
        data = torch.empty(sum(m.nbytes for m in metas), dtype=torch.uint8, device=self.group.device)
        bucket = self._buckets_received
        try:
            self.group.broadcast(data, src=0)
        except Exception as error:
            self.leave()
            raise RuntimeError(f"bucket {bucket} of version {version}: receive failed: {error}") from error
        if checksum is not None and (got := bucket_checksum(data)) != checksum:
            self.abort()
            raise ValueError(
                f"bucket {bucket} of version {version}: checksum mismatch (announced {checksum}, "
                f"received {got}); bucket rejected, still serving version {self.version}"
            )
        tensors = [(name, t.to(self.device)) for name, t in unpack(data, metas)]
        self._staged.update(tensors)
        self._buckets_received += 1
        return tensors

    def stage_from_disk(self, model_path: str | Path, weight_version: str | int) -> list[str]:
        """Stage every tensor of the `*.safetensors` files in `model_path`; returns their names."""
        from safetensors.torch import load_file

        files = sorted(Path(model_path).glob("*.safetensors"))
        if not files:
            raise ValueError(f"model_path: no *.safetensors files in {model_path}")
        self._begin(weight_version)
        for file in files:
            self._staged.update(load_file(file, device=str(self.device)))
        return sorted(self._staged)

    def commit(self, weight_version: str | int) -> dict[str, torch.Tensor]:
        """Make the staged version the served one; returns its tensors (by HF name)."""
        version = _parse_version(weight_version)
        if self._staged_version != version:
            raise RuntimeError(
                f"commit of version {version}, but the staged version is {self._staged_version}"
            )
        tensors, self._staged = self._staged, {}
        self.version, self._staged_version = version, None
        return tensors

    def abort(self) -> None:
        """Drop an uncommitted staged version (the engine keeps serving `self.version`)."""
        self._staged, self._staged_version, self._buckets_received = {}, None, 0

    def _begin(self, weight_version: str | int) -> int:
        version = _parse_version(weight_version)
        if version <= self.version:
            raise ValueError(
                f"weight_version: {version} is stale or repeated (serving {self.version}); "
                f"versions must increase"
            )
        if self._staged_version != version:  # a new version: forget an abandoned one
            self.abort()
            self._staged_version = version
        return version


def _parse_version(weight_version: str | int) -> int:
    try:
        return int(weight_version)
    except (TypeError, ValueError):
        raise ValueError(f"weight_version: {weight_version!r} is not an integer") from None
