"""The embedded engine's LoRA routes, with SGLang 0.5.23's bodies, answers and registry rules.

Routes: `/load_lora_adapter` {lora_name, lora_path, pinned}, `/load_lora_adapter_from_tensors`
{lora_name, config_dict, serialized_named_tensors, load_format, expected_checksums, pinned}
(`moe_rl.engine.lora_tensors`; one TP rank: entry 0 is decoded, as SGLang's rank 0 does) and
`/unload_lora_adapter` {lora_name}. Every answer is SGLang's `LoRAUpdateOutput` {success,
error_message, loaded_adapters: {name: lora_path}} (`"__tensor__"` for tensor loads), HTTP 400
when success is false.

Registry rules (SGLang's `LoRARegistry` and `TokenizerControlMixin`): names are unique (loading a
loaded name fails with SGLang's message); loads and unloads run one at a time; `/generate` with a
`lora_path` takes a use of the adapter (`acquire`) or fails that request alone when the name is not
registered; an unload first unregisters the name (new requests naming it fail), then waits until
every request still using it has finished (they are never failed), then drops its weights.
Everything here runs on the server's event loop; the model changes on the scheduler thread: the
server hands in how it reads a checked body (`read_body`) and how it runs a call there
(`on_scheduler`), so this module does not import the server.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any, Awaitable, Callable

from aiohttp import web

from moe_rl.engine.embedded.lora import TENSOR_PATH, LoraAdapter
from moe_rl.engine.embedded.runner import ModelRunner
from moe_rl.engine.lora_tensors import LOAD_FORMATS, check_checksums, decode_payload


class LoraRoutes:
    def __init__(
        self,
        runner: ModelRunner,
        read_body: Callable[[web.Request], Awaitable[dict]],
        on_scheduler: Callable[[Callable[[], Any]], Awaitable[Any]],
    ):
        """`read_body`: the server's parse-and-check of a request body; `on_scheduler(fn)`: runs
        `fn` on the scheduler thread (between two decode steps) and returns its result."""
        self.runner, self._read_body, self._on_scheduler = runner, read_body, on_scheduler
        self.paths: dict[str, str] = {}
        """Registered adapters (name -> lora_path): what `/generate` may name."""
        self._users: collections.Counter[str] = collections.Counter()
        self._idle: dict[str, asyncio.Event] = {}
        self._pending: set[str] = set()  # unregistered, weights not dropped yet (an unload cut short)
        self._lock: asyncio.Lock | None = None  # made on the loop that serves

    def routes(self) -> dict:
        return {
            "/load_lora_adapter": self.load,
            "/load_lora_adapter_from_tensors": self.load_from_tensors,
            "/unload_lora_adapter": self.unload,
        }

    @property
    def max_tensor_body_bytes(self) -> int:
        """A tensor load's body: an adapter is smaller than the model; base64 adds a third."""
        return (1 << 20) + 2 * sum(shape.numel() * dtype.itemsize for shape, dtype in self.runner._layout.values())

    # -- uses by /generate -------------------------------------------------------------------------

    def check(self, name: str | None) -> None:
        """Raise (HTTP 400) unless `name` is None or a loaded adapter."""
        if name is not None and name not in self.paths:
            raise ValueError(
                f"lora_path: the following requested LoRA adapters are not loaded: {name}; "
                f"loaded adapters: {sorted(self.paths)} (call /load_lora_adapter first)"
            )

    def acquire(self, name: str | None) -> None:
        self.check(name)
        if name is None:
            return
        self._users[name] += 1
        self._idle.setdefault(name, asyncio.Event()).clear()

    def release(self, name: str | None) -> None:
        if name is None:
            return
        self._users[name] -= 1
        if self._users[name] <= 0:
            del self._users[name]
            self._idle.pop(name, asyncio.Event()).set()

    # -- routes ------------------------------------------------------------------------------------

    def _answer(self, error: str | None = None) -> web.Response:
        body = {"success": error is None, "error_message": error or "", "loaded_adapters": dict(self.paths)}
        return web.json_response(body, status=200 if error is None else 400)

    def _name(self, body: dict) -> str:
        name, pinned = body["lora_name"], body.get("pinned", False)
        if not isinstance(name, str) or not name:
            raise ValueError(f"lora_name must be a non-empty string, got {name!r}")
        if not isinstance(pinned, bool):
            raise ValueError(f"pinned must be true or false, got {pinned!r}")
        return name

    async def _load(self, name: str, path: str, make) -> web.Response:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if name in self._pending:
                return self._answer(
                    f"LoRA adapter '{name}' has an incomplete unload. Retry the unload before loading it again."
                )
            if name in self.paths:  # SGLang's LoRAManager.validate_new_adapter
                return self._answer(f"Failed to load LoRA adapter {name} because it is already loaded")
            try:
                adapter = await asyncio.to_thread(make)
                await self._on_scheduler(lambda: self.runner.add_lora(adapter))
            except (ValueError, RuntimeError) as error:
                return self._answer(str(error))
            self.paths[name] = path
            return self._answer()

    async def load(self, http: web.Request) -> web.Response:
        body = await self._read_body(http)
        name, path = self._name(body), body["lora_path"]
        if not isinstance(path, str) or not path:
            raise ValueError(f"lora_path must be a non-empty string (a PEFT adapter directory), got {path!r}")
        return await self._load(name, path, lambda: LoraAdapter.from_dir(name, path))

    async def load_from_tensors(self, http: web.Request) -> web.Response:
        body = await self._read_body(http.clone(client_max_size=self.max_tensor_body_bytes))
        name, payloads = self._name(body), body["serialized_named_tensors"]
        load_format, checksums = body.get("load_format"), body.get("expected_checksums")
        if not isinstance(payloads, list) or not payloads or not all(isinstance(p, str) for p in payloads):
            raise ValueError("serialized_named_tensors must be a non-empty list of base64 strings (one per TP rank)")
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format={load_format!r}: use one of {LOAD_FORMATS}")
        if checksums is not None and not (
            isinstance(checksums, dict) and all(isinstance(v, str) for v in checksums.values())
        ):
            raise ValueError("expected_checksums must be an object {tensor name: sha256 hex}")
        if body.get("added_tokens_config"):
            raise ValueError("added_tokens_config: adapters that add tokens are not supported (as in SGLang)")

        def make() -> LoraAdapter:
            tensors = decode_payload(payloads[0], load_format)  # this engine is TP rank 0 of 1
            check_checksums(tensors, checksums)
            return LoraAdapter(name, TENSOR_PATH, body["config_dict"], tensors)

        return await self._load(name, TENSOR_PATH, make)

    async def unload(self, http: web.Request) -> web.Response:
        name = self._name(await self._read_body(http))
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if name not in self.paths and name not in self._pending:  # SGLang's LoRARegistry.unregister
                return self._answer(f"LoRA with name {name} does not exist. Loaded LoRAs: {sorted(self.paths)}")
            self.paths.pop(name, None)  # new requests naming it fail from now on
            self._pending.add(name)  # until its weights are dropped (a cancelled unload is retried)
            if name in self._idle:  # requests still using it finish first (SGLang's wait_for_unload)
                await self._idle[name].wait()
            await self._on_scheduler(lambda: self.runner.remove_lora(name))
            self._pending.discard(name)
            return self._answer()
