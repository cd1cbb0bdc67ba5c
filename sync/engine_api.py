"""What the sync package needs from an inference engine: the `EngineEndpoint` protocol.

`sync` never imports `moe_rl`. The engine client in `moe_rl.engine` (one client for SGLang and
for the embedded CPU engine) implements this protocol; the sender drives it. Every method is a
coroutine that maps to one SGLang HTTP route, with SGLang's field names (SGLang 0.5.23,
`sglang/srt/entrypoints/http_server.py`, `managers/io_struct.py`), and raises on failure
(HTTP error, `success: false`, connection lost) with the engine's message in the exception.

The update, as the sender drives it (one version; SGLang 0.5.23's contract, which the embedded
engine follows):

1. `pause_generation(mode)` on every engine, then `flush_cache()` unless the mode is `in_place`
   (SGLang refuses a flush while paused requests sit in its running batch).
2. `begin_weight_update()`: SGLang refuses `/update_weights_from_distributed` and
   `/update_weights_from_tensor` outside a `/begin_weight_update` ... `/end_weight_update`
   session, and refuses a second begin while one is open (disk updates need no session).
3. Per bucket: `update_weights_from_distributed(names, dtypes, shapes, group_name,
   weight_version=None, load_format="flattened_bucket", checksum)` on every engine, concurrently
   with the broadcast of that bucket's flat uint8 buffer (rank 0 = trainer source). The call
   returns once the engine received and loaded the bucket: that is the ack. No `weight_version`:
   SGLang sets its served version from the first bucket that carries one, before the rest of the
   weights arrived. Disk transport instead: one `update_weights_from_disk(model_path, version)`.
4. `end_weight_update()` on every engine, after a failure too (an unclosed session makes the
   next begin fail).
5. Commit: `update_weight_version(new_version)` (field `new_version`), only once every engine
   acknowledged every bucket: from now on the engine labels its tokens with the new version.
6. `continue_generation()`: on success, on every engine. After a failure, only on engines whose
   weights were not touched: SGLang loads every bucket in place (no staging), so an engine that
   received part of a version holds a mix of two versions while still labelled as the old one.
   It stays paused, unserved, until a full resend of the version succeeds (or it is restarted).

Integrity: `checksum` ("crc32:%08x#k": CRC-32 of the bucket's bytes, see `sync.bucket`, and
the bucket's index k in the version) is an embedded-engine extension, not an SGLang field: it is
computed only when an engine `verifies_checksums`, and the client sends it to embedded engines
only, which verify it and use k to run the collectives in bucket order (the sender keeps two
buckets in flight, whose HTTP calls may arrive in either order). The embedded engine also
stages buckets and swaps them in at the commit (another extension; it answers the commit before
the swap, and starts no request and answers no other control call but pause, continue and abort
until the swap is done); the sender's correctness
never relies on either, except under `pause_mode: none`, which only an engine that
`stages_versions` takes: it keeps generating on the served version while the buckets arrive.
Deltas (`sync.delta`) are a third extension: an engine that `applies_deltas` takes buckets of
payloads announced with load_format `sync.delta.DELTA_LOAD_FORMAT`; over `cuda_ipc`, SGLang engines
that list `sync.delta.SGLANG_LOADER` among their `custom_weight_loaders` take them through
`/update_weights_from_tensor` (`Transport.takes_deltas`); the sender sends full versions to any other.

Group membership follows SGLang's `/init_weights_update_group` (master_address, master_port,
rank_offset, world_size, group_name, backend): the trainer source is rank 0 and each engine
takes `num_group_ranks()` consecutive ranks from its `rank_offset`: SGLang puts each TP rank in
the group (`tp_size`, read from `/server_info`), the embedded engine one.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class EngineEndpoint(Protocol):
    """One inference engine as the weight sender sees it (implemented by moe_rl's client)."""

    name: str  # names the engine in errors, e.g. "engine-1 (http://127.0.0.1:30001)"
    verifies_checksums: bool  # checks update_weights_from_distributed's `checksum` (the embedded engine)
    applies_deltas: bool  # takes buckets of `sync.delta` payloads (load_format DELTA_LOAD_FORMAT; embedded engine)
    stages_versions: bool  # serves the committed version while the next one arrives (pause_mode none; embedded)

    async def num_group_ranks(self) -> int:
        """GET /server_info: the ranks this engine puts into the weight-update group (tp_size)."""

    async def health(self) -> bool:
        """GET /health: False when the engine does not answer (dead), never raises."""

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
        weight_version: str | None,
        load_format: str,
        checksum: str | None,
    ) -> None:
        """POST /update_weights_from_distributed: receive and load one broadcast bucket (the ack)."""

    async def begin_weight_update(self) -> None:
        """POST /begin_weight_update: open the session the bucket routes need."""

    async def end_weight_update(self) -> None:
        """POST /end_weight_update: close it (SGLang finalizes the loaded weights here)."""

    async def update_weights_from_disk(self, model_path: str, weight_version: str) -> None:
        """POST /update_weights_from_disk: load safetensors files from a directory."""

    async def update_weight_version(self, new_version: str) -> None:
        """POST /update_weight_version: commit; the engine serves `new_version` from now on."""

    async def pause_generation(self, mode: str) -> None:
        """POST /pause_generation with mode abort | retract | in_place."""

    async def continue_generation(self) -> None:
        """POST /continue_generation (the embedded engine drops an uncommitted staged version)."""

    async def flush_cache(self) -> None:
        """POST /flush_cache."""


@runtime_checkable
class ColocatedEngineEndpoint(EngineEndpoint, Protocol):
    """An engine on the trainer's own GPUs, for the `cuda_ipc` transport (SGLang 0.5.23)."""

    async def update_weights_from_tensor(
        self, serialized_named_tensors: list[str], load_format: str, weight_version: str | None
    ) -> None:
        """POST /update_weights_from_tensor with `serialized_named_tensors` (one base64
        `MultiprocessingSerializer` payload per engine TP rank), `load_format`
        ("flattened_bucket", or `sync.delta.SGLANG_LOADER`), `weight_version` (None: see step 3),
        `flush_cache: false`: load one bucket (the ack). SGLang's rank r deserializes
        `serialized_named_tensors[r]`."""

    async def custom_weight_loaders(self) -> list[str]:
        """GET /server_info: the import paths SGLang may load updates with (`--custom-weight-loader`)."""
