"""What the sync package needs from an inference engine: the `EngineEndpoint` protocol.

`sync` never imports `moe_rl`. The engine client in `moe_rl.engine` (one client for SGLang and
for the embedded CPU engine) implements this protocol; the sender drives it. Every method is a
coroutine that maps to one SGLang HTTP route, with SGLang's field names (SGLang 0.5.23,
`sglang/srt/entrypoints/http_server.py`, `managers/io_struct.py`), and raises on failure
(HTTP error, `success: false`, connection lost) with the engine's message in the exception.

The update, as the sender drives it (one version):

1. `pause_generation(mode)` then `flush_cache()` on every engine.
2. Per bucket: `update_weights_from_distributed(names, dtypes, shapes, group_name,
   weight_version, load_format="flattened_bucket", checksum)` on every engine, concurrently
   with the broadcast of that bucket's flat uint8 buffer (rank 0 = trainer source). The call
   returns once the engine received (and, where it can, verified) the bucket: that is the ack.
   Disk transport instead: one `update_weights_from_disk(model_path, weight_version)`.
3. Commit: `update_weight_version(new_version)` (SGLang's `/update_weight_version`, field
   `new_version`), only once every engine acknowledged every bucket.
4. `continue_generation()` on every engine, whether the update committed or not.

Why SGLang's own paths give atomicity: SGLang has no explicit commit in its distributed update;
it loads each bucket in place while generation is paused, and sets the served version from
the `weight_version` field. The embedded engine stages received buckets instead and swaps them
in when `/update_weight_version` arrives with that version; `/continue_generation` with an
uncommitted staged version discards it (`WeightReceiver.abort()`), so a failed sync leaves it
serving the previous version. On SGLang a failed distributed sync leaves weights partly loaded
(SGLang's own warning says so); the sender then reports the engine and bucket and does not
commit the version, and the orchestrator must resync that engine before trusting it.

Integrity: `checksum` ("crc32:%08x#k": CRC-32 of the bucket's bytes, see `sync.bucket`, and
the bucket's index k in the version) is not an SGLang field; a client for SGLang leaves it out
of the request, the embedded engine verifies it and uses k to run the collectives in bucket
order (the sender keeps two buckets in flight, whose HTTP calls may arrive in either order).

Group membership follows SGLang's `/init_weights_update_group` (master_address, master_port,
rank_offset, world_size, group_name, backend): the trainer source is rank 0 and each engine
takes `num_group_ranks` consecutive ranks from its `rank_offset` (SGLang: its tp_size; the
embedded engine: 1).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class EngineEndpoint(Protocol):
    """One inference engine as the weight sender sees it (implemented by moe_rl's client)."""

    name: str  # names the engine in errors, e.g. "engine-1 (http://127.0.0.1:30001)"
    num_group_ranks: int  # ranks this engine puts into the weight-update group

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> None:
        """POST /init_weights_update_group: join the group (blocks until rank 0 joins too)."""

    async def destroy_weights_update_group(self, group_name: str) -> None:
        """POST /destroy_weights_update_group: leave the group; a no-op if not joined."""

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: str,
        load_format: str,
        checksum: str | None,
    ) -> None:
        """POST /update_weights_from_distributed: receive one broadcast bucket (the ack)."""

    async def update_weights_from_disk(self, model_path: str, weight_version: str) -> None:
        """POST /update_weights_from_disk: load safetensors files from a directory."""

    async def update_weight_version(self, new_version: str) -> None:
        """POST /update_weight_version: commit; the engine serves `new_version` from now on."""

    async def pause_generation(self, mode: str) -> None:
        """POST /pause_generation with mode abort | retract | in_place."""

    async def continue_generation(self) -> None:
        """POST /continue_generation (drops an uncommitted staged version on the embedded engine)."""

    async def flush_cache(self) -> None:
        """POST /flush_cache."""


@runtime_checkable
class ColocatedEngineEndpoint(EngineEndpoint, Protocol):
    """An engine on the trainer's own GPUs, for the `cuda_ipc` transport (SGLang 0.5.23)."""

    async def update_weights_from_tensor(
        self, serialized_named_tensors: list[str], load_format: str, weight_version: str
    ) -> None:
        """POST /update_weights_from_tensor with `serialized_named_tensors` (one base64
        `MultiprocessingSerializer` payload per engine TP rank), `load_format`
        ("flattened_bucket"), `weight_version`, `flush_cache: false`: load one bucket (the ack)."""
