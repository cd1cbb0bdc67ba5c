"""The embedded engine's HTTP server (aiohttp): SGLang's paths and fields around the scheduler.

Every handler validates its body first (unknown or missing fields, bad values: HTTP 400 with
`{"error": {"message": ...}}` naming the field, SGLang's error shape) and the server keeps serving.
Long blocking work (loading weights, joining the weight-update group, receiving a bucket) runs in
worker threads; only the final swap runs on the scheduler thread, between two decode steps.

Weight updates (`sync.receiver.WeightReceiver` does the group and the staging), with SGLang
0.5.23's session rules: `/update_weights_from_distributed` and `/update_weights_from_tensor` (a
bucket by CUDA-IPC handles, `sync.flattened_payload`; the model on `--device cuda`) are refused outside a
`/begin_weight_update` ... `/end_weight_update` session, and a begin while one is open is refused.
`/update_weights_from_disk` loads, swaps and sets the version at once (SGLang's behaviour, no
session). `/update_weights_from_distributed` stages one bucket; `/update_weight_version` commits
the staged version (or, with nothing staged, relabels the served weights as SGLang does);
`/continue_generation` drops an uncommitted staged version.

A commit is answered before its swap: the staged tensors are the engine's from then on (they
passed their checksums), so the caller (the trainer's sender) does not wait for the spare model's
load and the forward under way. From the answer on, no request starts under the old version (the
scheduler holds new ones until the swap) and every control call but pause, continue and abort
waits for the swap first (so /model_info names the new version, and the next update finds the
last one in). Requests already running go on under the old version until the swap, their tokens
tagged with it. A swap that fails then (a bug: the tensors were checked) leaves the old version
served, /health answering 503 and every waiting control call 500, naming the error: the engine is
restarted as a dead one is. Staging is an embedded-engine
extension (SGLang loads each bucket in place): the served weights and their label change
together, at the commit. Buckets that name a `weight_version` (SGLang labels the engine with it
at the first bucket) are committed as that version at `/end_weight_update` instead.

LoRA (`lora_routes`, `lora`, `lora_hooks`): SGLang's three LoRA routes and registry rules; `/generate`
with `lora_path` takes a use of that adapter for the request's life (an unknown name fails that
request alone, 400), and an unload waits for the requests still using it.

Memory occupation (colocated RL): `/release_memory_occupation` (idle engine only, as SGLang asserts)
frees the weights (`ModelRunner.release_weights`) and/or the KV cache; `/resume_memory_occupation`
re-allocates them; the weights hold nothing valid until a full weight update. While anything is
released or not reloaded, `/generate` is refused (400) with a message saying so.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import faulthandler
import json
import math
import signal
import sys
import threading
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

from aiohttp import web

from moe_rl.engine import protocol
from moe_rl.engine.client import EngineClient
from moe_rl.engine.embedded.classifier import ClassifierServer, is_classifier
from moe_rl.engine.embedded.lora_routes import LoraRoutes
from moe_rl.engine.embedded.request import Request
from moe_rl.engine.embedded.runner import ModelRunner, load_checkpoint_state
from moe_rl.engine.embedded.scheduler import Scheduler
from moe_rl.engine.process import EmbeddedConfig
from moe_rl.engine.sampling import SamplingParams
from moe_rl.trace import TRACER
from parallel.bridges.rope import max_positions
from sync import peer_feed, published
from sync.config import SyncConfig
from sync.delta import DELTA_LOAD_FORMAT
from sync.flattened_payload import decode
from sync.group import address_for
from sync.receiver import WeightReceiver


class BadRequest(ValueError):
    pass


_INLINE_BYTES = 1 << 16
"""Request bodies up to this size are parsed on the event loop (`EmbeddedServer._body`)."""

# paths without a span of their own: generation shows as the scheduler's forwards, and polls are noise
_UNTRACED = frozenset(
    {"/generate", "/health", "/health_generate", "/get_load", "/v1/loads", "/start_trace", "/stop_trace"}
)
# paths that need not wait for an answered commit's swap (the scheduler orders them after it)
_BESIDE_SWAP = _UNTRACED | {"/pause_generation", "/continue_generation", "/abort_request"}


class SwapFailed(Exception):
    """The swap of an answered commit failed: the engine serves the old version (HTTP 500)."""


def _check(body: object, path: str) -> dict:
    if not isinstance(body, dict):
        raise BadRequest(f"{path}: the body must be a JSON object")
    unknown = protocol.unknown_fields(path, body)
    if unknown:
        raise BadRequest(
            f"{path}: unknown field(s) {unknown}; its fields are "
            f"{sorted(protocol.REQUEST_FIELDS.get(path) or protocol.EMBEDDED_ROUTES[path])}"
        )
    missing = [f for f in protocol.REQUIRED_FIELDS.get(path, ()) if f not in body]
    if missing:
        raise BadRequest(f"{path}: missing required field(s) {missing}")
    return body


def _not_a_number(value: object) -> bool:
    return isinstance(value, bool) or not isinstance(value, (int, float))


def _int(value: object, name: str, low: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low):
        raise BadRequest(f"{name} must be an integer{f' >= {low}' if low is not None else ''}, got {value!r}")
    return value


class EmbeddedServer:
    def __init__(
        self,
        model_dir: str,
        weight_version: str = "0",
        max_batch: int = 64,
        device: str = "cpu",
        speculative_steps: int = 0,
    ):
        self.runner = ModelRunner(model_dir, device, speculative_steps)
        self.scheduler = Scheduler(self.runner, weight_version, max_batch)
        self.receiver = WeightReceiver(version=int(weight_version) if weight_version.isdigit() else 0)
        eos = getattr(self.runner.config.get_text_config(), "eos_token_id", None)
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self.max_positions = max_positions(self.runner.config.get_text_config()) or 1 << 30  # YaRN's scaled ones too
        self._rids: set[str] = set()
        self._session = False  # a /begin_weight_update ... /end_weight_update session is open
        self._swapping: asyncio.Future | None = None  # the swap of the last answered commit
        self.broken: str | None = None  # why that swap failed (the engine must be restarted)
        self.released: set[str] = set()  # memory tags released by /release_memory_occupation
        self.lora = LoraRoutes(self.runner, self._body, self._on_scheduler)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self._errors])
        routes = {
            "/generate": self.generate,
            "/pause_generation": self.pause,
            "/continue_generation": self.continue_generation,
            "/abort_request": self.abort,
            "/update_weights_from_disk": self.update_from_disk,
            "/init_weights_update_group": self.init_group,
            "/destroy_weights_update_group": self.destroy_group,
            "/update_weights_from_distributed": self.update_from_distributed,
            "/update_weights_from_tensor": self.update_from_tensor,
            "/update_weight_version": self.update_version,
            "/begin_weight_update": self.begin_update,
            "/end_weight_update": self.end_update,
            "/release_memory_occupation": self.release_memory,
            "/resume_memory_occupation": self.resume_memory,
            "/start_trace": self.start_trace,
            "/stop_trace": self.stop_trace,
            "/feed_peers": self.feed_peers,
            **self.lora.routes(),
        }
        for path, handler in routes.items():
            app.router.add_post(path, handler)
        app.router.add_put("/generate", self.generate)
        app.router.add_route("*", "/flush_cache", self.flush_cache)
        for path in ("/health", "/health_generate"):
            app.router.add_get(path, self.health)
        for path in ("/model_info", "/get_model_info"):
            app.router.add_get(path, self.model_info)
        for path in ("/server_info", "/get_server_info"):
            app.router.add_get(path, self.server_info)
        app.router.add_get("/get_load", self.get_load)
        app.router.add_get("/v1/loads", self.loads)
        app.on_startup.append(self._startup)
        app.on_shutdown.append(self._shutdown)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            if request.path not in _BESIDE_SWAP:
                await self._swapped()
            if request.path in _UNTRACED:
                return await handler(request)
            with TRACER.span(request.path.lstrip("/"), lane="http"):  # the control calls, one at a time
                return await handler(request)
        except ValueError as error:  # BadRequest and the receiver's / runner's input errors
            return web.json_response(
                {"error": {"message": str(error)}, "success": False, "message": str(error)}, status=400
            )
        except RuntimeError as error:  # calls in the wrong order (e.g. a bucket before joining)
            return web.json_response(
                {"error": {"message": str(error)}, "success": False, "message": str(error)}, status=400
            )
        except web.HTTPException:
            raise
        except Exception as error:  # an engine fault: reported, the server keeps serving
            message = f"{type(error).__name__}: {error}"
            return web.json_response({"error": {"message": message}, "success": False, "message": message}, status=500)

    @property
    def max_body_bytes(self) -> int:
        """The largest body a request can need: a /generate batch of max_batch full contexts (about
        8 bytes of JSON per token id) plus room for the rest; larger bodies get 413 before they are read."""
        return (1 << 20) + 8 * min(self.max_positions, 1 << 24) * self.scheduler.max_batch

    async def _body(self, request: web.Request) -> dict:
        if not request.can_read_body:
            return _check({}, request.path)
        raw = await request.read()
        try:  # a large body is parsed off the event loop (it never stalls /health); a small one here,
            # where a thread hop would cost more than the parse
            body = json.loads(raw) if len(raw) <= _INLINE_BYTES else await asyncio.to_thread(json.loads, raw)
        except ValueError:
            raise BadRequest(f"{request.path}: the body is not valid JSON") from None
        return _check(body, request.path)

    async def _on_scheduler(self, fn):
        return await asyncio.wrap_future(self.scheduler.call(fn))

    async def _startup(self, app) -> None:
        self.handoff = Handoff(asyncio.get_running_loop())

    async def _shutdown(self, app) -> None:
        self.scheduler.stop()
        self.receiver.leave()

    # -- generation --------------------------------------------------------------------------------

    async def generate(self, http: web.Request) -> web.Response:
        """One request, or SGLang's batch form (`input_ids` a list of lists: one response list, in
        order, once every item has ended; `split_batch`)."""
        body = await self._body(http)
        items = protocol.split_batch(body)
        small = http.content_length is not None and http.content_length <= _INLINE_BYTES
        parse = lambda: [self._parse_generate(item) for item in items or [body]]  # noqa: E731
        # per-id checks of a long prompt off the loop
        requests = parse() if small else await asyncio.to_thread(parse)
        if len({r.rid for r in requests}) < len(requests):
            raise BadRequest(f"rid: {[r.rid for r in requests]} must be distinct within a batch")
        if self.runner.weights_state != "loaded":  # an answered commit may be loading them (colocated)
            await self._swapped()
        if self.released or self.runner.weights_state != "loaded":
            raise RuntimeError(
                f"/generate refused: memory released {sorted(self.released)}, weights "
                f"{self.runner.weights_state}; call /resume_memory_occupation and update the weights"
            )
        if items is None:
            return web.json_response(await self._run(requests[0]))
        for request in requests:  # an unknown adapter fails the batch before any item starts
            self.lora.check(request.lora_name)
        tasks = [asyncio.ensure_future(self._run(request)) for request in requests]
        try:
            return web.json_response(list(await asyncio.gather(*tasks)))
        finally:  # an item that failed (or the client leaving) ends the others: each aborts its request
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, request: Request) -> dict:
        """Submit `request` and wait for its result; a cancelled wait (the client went away) aborts it."""
        self.lora.acquire(request.lora_name)  # an unknown adapter fails this request only
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        request.on_done = lambda result: self.handoff.put(done, result)
        self._rids.add(request.rid)
        try:
            self.scheduler.submit(request)
            return await done
        except asyncio.CancelledError:  # stop generating for it
            self.scheduler.call(lambda: self.scheduler.abort(request.rid))
            raise
        finally:
            self._rids.discard(request.rid)
            self.lora.release(request.lora_name)  # an unload waiting for it may go on

    def _parse_generate(self, body: dict) -> Request:
        raw = body.get("sampling_params") or {}
        if not isinstance(raw, dict):
            raise BadRequest("sampling_params must be a JSON object")
        for prefix, values, fields in (
            ("", body, protocol.GENERATE_FIELDS),
            ("sampling_params.", raw, protocol.SAMPLING_FIELDS),
        ):
            for field in sorted(fields & values.keys() & protocol.EMBEDDED_UNSUPPORTED.keys()):
                default = protocol.EMBEDDED_UNSUPPORTED[field]
                if values[field] not in (default, protocol.DEFAULT_EQUIVALENTS.get(field, default)):
                    raise BadRequest(
                        f"{prefix}{field}={values[field]!r} is not supported by the embedded "
                        f"engine (leave it at SGLang's default {default!r})"
                    )
        ids = body["input_ids"]
        if not isinstance(ids, list) or not ids:
            raise BadRequest("input_ids must be a non-empty list of token ids")
        vocab = self.runner.vocab_size
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"input_ids: {bad[:5]} outside the vocabulary [0, {vocab})")
        # None is the default for every sampling field, as in SGLang's SamplingParams.__post_init__;
        # max_new_tokens=None generates up to the context length (SGLang clips to it).
        honoured = {f.name for f in dataclasses.fields(SamplingParams)}
        params = SamplingParams(**{k: v for k, v in raw.items() if k in honoured and v is not None})
        if "max_new_tokens" in raw and raw["max_new_tokens"] is None:
            params.max_new_tokens = max(1, self.max_positions - len(ids))
        _int(params.max_new_tokens, "sampling_params.max_new_tokens", low=0)  # 0: prefill only (scoring)
        _int(params.top_k, "sampling_params.top_k", low=-1)
        if params.top_k == 0:
            raise BadRequest("sampling_params.top_k must be -1 (all) or >= 1, got 0")
        if _not_a_number(params.temperature) or not math.isfinite(params.temperature) or params.temperature < 0:
            raise BadRequest(f"sampling_params.temperature must be a finite number >= 0, got {params.temperature!r}")
        if _not_a_number(params.top_p) or not 0 < params.top_p <= 1:
            raise BadRequest(f"sampling_params.top_p must be in (0, 1], got {params.top_p!r}")
        params.stop_token_ids = [_int(t, "sampling_params.stop_token_ids[]", 0) for t in params.stop_token_ids or []]
        if params.sampling_seed is not None:
            _int(params.sampling_seed, "sampling_params.sampling_seed")
        if len(ids) + params.max_new_tokens > self.max_positions:
            raise BadRequest(
                f"len(input_ids) + max_new_tokens = {len(ids) + params.max_new_tokens} exceeds the model's "
                f"{self.max_positions} positions (max_position_embeddings, or with YaRN factor x original)"
            )
        rid = body.get("rid") or uuid.uuid4().hex
        if not isinstance(rid, str) or rid in self._rids:
            raise BadRequest(f"rid {rid!r} must be a string not used by a running request")
        start = _int(body.get("routed_experts_start_len", 0), "routed_experts_start_len", 0)
        if start > len(ids):
            raise BadRequest(f"routed_experts_start_len={start} must be in [0, len(input_ids)={len(ids)}]")
        logprob_start = body.get("logprob_start_len")
        logprob_start = -1 if logprob_start is None else _int(logprob_start, "logprob_start_len", -1)
        if logprob_start > len(ids):  # SGLang aborts such a request with the same advice
            raise BadRequest(f"logprob_start_len={logprob_start} is above len(input_ids)={len(ids)}: use a smaller one")
        lora = body.get("lora_path")  # SGLang: the name of a loaded adapter (checked on the loop, `LoraRoutes.acquire`)
        if lora is not None and not isinstance(lora, str):
            raise BadRequest(f"lora_path must be the name of a loaded adapter (a string), got {lora!r}")
        return Request(
            rid=rid,
            input_ids=list(ids),
            params=params,
            eos_token_ids=self.eos_token_ids,
            return_logprob=bool(body.get("return_logprob")),
            logprob_start_len=logprob_start if body.get("return_logprob") else -1,  # SGLang ignores it then
            return_routed_experts=bool(body.get("return_routed_experts")),
            routed_experts_start_len=start,
            lora_name=lora,
        )

    # -- control -----------------------------------------------------------------------------------

    async def pause(self, http: web.Request) -> web.Response:
        mode = (await self._body(http)).get("mode", "abort")
        if mode not in protocol.PAUSE_MODES:
            raise BadRequest(f"mode={mode!r}: use one of {protocol.PAUSE_MODES}")
        await self._on_scheduler(lambda: self.scheduler.pause(mode))
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, http: web.Request) -> web.Response:
        await self._body(http)
        self.receiver.abort()  # an uncommitted staged version is dropped (sync.engine_api)
        await self._on_scheduler(self.scheduler.unpause)
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def abort(self, http: web.Request) -> web.Response:
        body = await self._body(http)
        rid = None if body.get("abort_all") else body.get("rid")
        if rid is None and not body.get("abort_all"):
            raise BadRequest("/abort_request: give rid, or abort_all=true")
        await self._on_scheduler(lambda: self.scheduler.abort(rid))
        return web.Response(status=200)

    async def flush_cache(self, http: web.Request) -> web.Response:
        if self.scheduler.num_requests and not self.scheduler.paused:
            return web.Response(status=400, text="Flush cache failed: requests are running.\n")
        return web.Response(status=200, text="Cache flushed.\n")

    async def start_trace(self, http: web.Request) -> web.Response:
        """Extension (not SGLang's): record this engine's spans (`moe_rl.trace`), named by the
        query's `process` (e.g. `/start_trace?process=engine-0`)."""
        TRACER.process = http.query.get("process", TRACER.process)
        TRACER.start()
        return web.json_response({"success": True})

    async def stop_trace(self, http: web.Request) -> web.Response:
        """Extension: stop recording; answers the spans (`Tracer.stop`)."""
        return web.json_response(TRACER.stop())

    async def health(self, http: web.Request) -> web.Response:
        if self.broken is not None:
            return web.Response(status=503, text=f"{self.broken}\n")
        return web.Response(status=200)

    async def model_info(self, http: web.Request) -> web.Response:
        describe = await self._on_scheduler(self.runner.describe)  # the scheduler thread owns the weights
        return web.json_response(
            {
                "model_path": self.runner.model_dir,
                "is_generation": True,
                "weight_version": self.scheduler.weight_version,
                "memory_released": sorted(self.released),
                **describe,
            }
        )

    async def server_info(self, http: web.Request) -> web.Response:
        # SGLang's /server_info is its resolved server args plus live state: the ones that describe
        # this engine, under SGLang's names (what clients read: tp/dp/pp sizes, model, version).
        steps = self.runner.speculative_steps
        return web.json_response(
            {
                "model_path": self.runner.model_dir,
                "tokenizer_path": self.runner.model_dir,
                "served_model_name": self.runner.model_dir,
                "skip_tokenizer_init": True,
                "tp_size": 1,
                "dp_size": 1,
                "pp_size": 1,
                "ep_size": 1,
                "attn_dp_size": 1,
                "context_length": self.max_positions,
                "max_running_requests": self.scheduler.max_batch,
                "weight_version": self.scheduler.weight_version,
                "enable_lora": True,
                "enable_memory_saver": True,
                "enable_return_routed_experts": True,
                # SGLang's speculative args: the MTP layer drafts a chain (`draft.MtpDraft`)
                "speculative_algorithm": "NEXTN" if steps else None,
                "speculative_num_steps": steps or None,
                "speculative_eagle_topk": 1 if steps else None,
                "speculative_num_draft_tokens": steps + 1 if steps else None,
                "version": "embedded",
            }
        )

    async def _load(self) -> dict:
        """One LoadSnapshot (SGLang's per-DP-rank load record, `managers/load_snapshot.py`), dp_rank 0."""
        running, waiting, used, queued = await self._on_scheduler(self.scheduler.load)
        load = dict.fromkeys(protocol.LOAD_FIELDS, 0)  # throughput, cache and prefill counters: not measured
        load.update(
            timestamp=time.time(),
            num_running_reqs=running,
            num_waiting_reqs=waiting,
            num_used_tokens=used,
            num_waiting_uncached_tokens=queued,
            num_total_tokens=used + queued,
            num_active_tokens=used + queued,
            max_running_requests=self.scheduler.max_batch,
            decode_moments=None,
        )
        return load

    async def get_load(self, http: web.Request) -> web.Response:
        # SGLang's get_load answer (entrypoints/grpc_bridge.py): the load of every DP rank
        return web.json_response([await self._load()])

    async def loads(self, http: web.Request) -> web.Response:
        # SGLang's /v1/loads envelope (entrypoints/v1_loads.py)
        return web.json_response(
            {
                "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                "version": "embedded",
                "accelerator": None,
                "num_accelerators": 0,
                "loads": [await self._load()],
            }
        )

    # -- memory occupation (colocated RL) ----------------------------------------------------------

    def _tags(self, body: dict) -> list[str]:
        tags = body.get("tags") or list(protocol.MEMORY_TAGS)
        if not isinstance(tags, list) or any(tag not in protocol.MEMORY_TAGS for tag in tags):
            raise BadRequest(f"tags={body.get('tags')!r}: use a list of {protocol.MEMORY_TAGS} (none = all)")
        return tags  # "cuda_graph": the embedded engine captures no graphs, nothing to do

    async def release_memory(self, http: web.Request) -> web.Response:
        tags = self._tags(await self._body(http))

        def release() -> None:
            if not self.scheduler.idle:
                raise RuntimeError(
                    "/release_memory_occupation needs an idle engine: pause generation "
                    "(abort or retract) or let the running requests finish first"
                )
            if "kv_cache" in tags:
                self.scheduler.release_kv_cache()
            if "weights" in tags:
                self.runner.release_weights()
            self.released.update(tags)

        await self._on_scheduler(release)
        return web.json_response({"success": True, "message": f"Released {tags}."})

    async def resume_memory(self, http: web.Request) -> web.Response:
        tags = self._tags(await self._body(http))

        def reallocate() -> None:
            if "weights" in tags:
                self.runner.reallocate_weights()
            self.released.difference_update(tags)

        await self._on_scheduler(reallocate)
        return web.json_response({"success": True, "message": f"Resumed {tags}; weights {self.runner.weights_state}."})

    # -- weights -----------------------------------------------------------------------------------

    async def _swap(self, tensors: dict, version: str, abort_all: bool) -> None:
        """Load `tensors` (`ModelRunner.checked`) into the spare model, then swap it in between two
        forwards as `version`."""
        staged = await asyncio.to_thread(self.runner.build_staged, tensors)

        def swap() -> None:
            if abort_all:
                self.scheduler.abort(None)
            self.scheduler.set_weights(staged, version)

        await self._on_scheduler(swap)

    def _version(self, value: object, field: str, same_ok: bool) -> str:
        """A weight version as the engine takes it: a non-negative integer (SGLang's string form, e.g.
        "3"), never older than the served one (equal only where `same_ok`: a reload), except the
        first commit over a newly joined group (`WeightReceiver.may_go_back`: a rollback)."""
        version, served = protocol.weight_version_number(value), self.scheduler.weight_version
        if version is None:
            raise BadRequest(
                f"{field}: {value!r} is not a weight version; versions are non-negative integers, "
                f'sent as strings (e.g. "3")'
            )
        going_back = served.isdigit() and (version < int(served) or (version == int(served) and not same_ok))
        rollback = field == "new_version" and self.receiver.may_go_back and self.receiver.staged
        if going_back and not rollback:
            raise BadRequest(
                f"{field}: {version} is not newer than the served version {served}; versions only increase"
            )
        return str(version)

    async def update_from_disk(self, http: web.Request) -> web.Response:
        """An anchor's safetensors files (SGLang's route), or a delta published on storage
        (`sync.published`), resolved from the served version or from the last anchor."""
        body = await self._body(http)
        version = self.scheduler.weight_version  # no weight_version: the label stays (SGLang)
        if body.get("weight_version") is not None:
            version = self._version(body["weight_version"], "weight_version", same_ok=True)
        path = Path(body["model_path"])
        if published.is_delta(path):
            tensors, resolved = await asyncio.to_thread(published.resolve, path, self.receiver.applied)
            if str(resolved) != version:
                raise BadRequest(f"model_path: {path} publishes version {resolved}, not {version}")
        else:
            tensors = await asyncio.to_thread(load_checkpoint_state, path)
        checked = await asyncio.to_thread(self.runner.checked, tensors)
        await self._swap(checked, version, bool(body.get("abort_all_requests")))
        self.receiver.loaded(tensors, int(version) if version.isdigit() else None)
        return web.json_response({"success": True, "message": f"Loaded {path}", "num_paused_requests": 0})

    async def feed_peers(self, http: web.Request) -> web.Response:
        """Extension: send the served version to joining engines over a group of their own and
        commit it there (`sync.peer_feed`), while this engine keeps generating. Body: `engines`
        (name -> URL), `bucket_bytes`, `timeout_s`, `backend`."""
        body = await self._body(http)
        engines = body.get("engines")
        if not isinstance(engines, dict) or not engines:
            raise BadRequest("engines: a non-empty mapping of engine name -> URL to feed")
        hosts = [urlsplit(url).hostname or "127.0.0.1" for url in engines.values()]
        config = SyncConfig(
            bucket_bytes=_int(body.get("bucket_bytes", 64 << 20), "bucket_bytes", 1),
            timeout_s=float(body.get("timeout_s", 120.0)),
            backend=body.get("backend"),
            master_address=address_for(hosts),
        )
        joiners = [EngineClient(url, kind="embedded", name=name, retries=1) for name, url in engines.items()]
        result = await asyncio.to_thread(peer_feed.feed, self.receiver, joiners, config)
        return web.json_response({"success": True, **dataclasses.asdict(result)})

    async def init_group(self, http: web.Request) -> web.Response:
        body = await self._body(http)
        await asyncio.to_thread(
            self.receiver.join,
            body["master_address"],
            _int(body["master_port"], "master_port", 1),
            _int(body["rank_offset"], "rank_offset", 1),
            _int(body["world_size"], "world_size", 2),
            body.get("group_name", "weight_update_group"),
            body.get("backend", "gloo"),
        )
        return web.json_response({"success": True, "message": "Joined the weight update group."})

    async def destroy_group(self, http: web.Request) -> web.Response:
        body = await self._body(http)
        self.receiver.leave(body.get("group_name"))  # one of the groups (one per trainer pipeline stage)
        return web.json_response({"success": True, "message": "Left the weight update group."})

    async def begin_update(self, http: web.Request) -> web.Response:
        await self._body(http)
        if self._session:  # SGLang's rule and message (scheduler_components/weight_updater.py)
            raise RuntimeError("a weight-update session is already open; call end_weight_update() first")
        self.receiver.begin()
        self._session = True
        return web.json_response({"success": True, "message": "Success"})

    async def end_update(self, http: web.Request) -> web.Response:
        await self._body(http)
        if not self._session:
            raise RuntimeError("no weight-update session is open; call begin_weight_update() first")
        self._session = False
        labelled = self.receiver.labelled_version
        if labelled is not None and self.receiver.staged:  # buckets named their version (see above)
            await self._swap(self.runner.checked(self.receiver.commit(labelled)), str(labelled), abort_all=False)
        return web.json_response({"success": True, "message": "Success"})

    def _require_session(self, route: str) -> None:
        """SGLang's rule: bucket routes only inside /begin_weight_update ... /end_weight_update."""
        if not self._session:
            raise RuntimeError(f"{route} must run between begin_weight_update() and end_weight_update()")

    async def update_from_distributed(self, http: web.Request) -> web.Response:
        body = await self._body(http)
        self._require_session("update_weights_from_distributed")
        formats = (None, "flattened_bucket", DELTA_LOAD_FORMAT)  # the second: a bucket of deltas (`sync.delta`)
        if body.get("load_format") not in formats:
            raise BadRequest(f"load_format={body['load_format']!r}: the embedded engine takes one of {formats[1:]}")
        await asyncio.to_thread(
            self.receiver.receive_bucket,
            body["names"],
            body["dtypes"],
            body["shapes"],
            body.get("weight_version"),
            body.get("checksum"),
            body.get("group_name"),
            body.get("load_format") == DELTA_LOAD_FORMAT,
        )
        return web.json_response({"success": True, "message": f"Staged {len(body['names'])} tensors."})

    async def update_from_tensor(self, http: web.Request) -> web.Response:
        """A bucket by CUDA-IPC handles (the `cuda_ipc` transport): staged like a broadcast bucket."""
        body = await self._body(http)
        self._require_session("update_weights_from_tensor")
        if body.get("load_format") != "flattened_bucket":
            raise BadRequest(f"load_format={body.get('load_format')!r}: the embedded engine takes 'flattened_bucket'")
        payloads = body["serialized_named_tensors"]
        if not isinstance(payloads, list) or not payloads or not all(isinstance(p, str) for p in payloads):
            raise BadRequest("serialized_named_tensors: a non-empty list of base64 payloads, one per TP rank")
        tensors = await asyncio.to_thread(decode, payloads[0], True)  # one TP rank: SGLang's rank 0 takes entry 0
        names = await asyncio.to_thread(self.receiver.stage_tensors, tensors, body.get("weight_version"))
        return web.json_response({"success": True, "message": f"Staged {len(names)} tensors."})

    async def update_version(self, http: web.Request) -> web.Response:
        body = await self._body(http)
        abort_all = body.get("abort_all_requests", True)
        if str(body["new_version"]) == self.scheduler.weight_version:
            return web.json_response({"success": True, "message": f"Already serving {body['new_version']}."})
        version = self._version(body["new_version"], "new_version", same_ok=False)
        tensors = self.receiver.commit(version) if self.receiver.staged else {}  # else SGLang's plain relabel
        tensors = self.runner.checked(tensors)  # what cannot load is refused now, not after the answer
        # answered now, swapped when the spare model is loaded (module docstring)
        self.scheduler.hold()
        self._swapping = asyncio.ensure_future(self._swap(tensors, version, abort_all))
        self._swapping.add_done_callback(self._after_swap)
        return web.json_response({"success": True, "message": f"Serving weight version {version}."})

    def _after_swap(self, swap: asyncio.Future) -> None:
        """An answered commit's swap is over: if it failed (or was cancelled), the engine is broken."""
        error = asyncio.CancelledError() if swap.cancelled() else swap.exception()
        if error is not None:
            self.broken = f"the committed version failed to load: {type(error).__name__}: {error}"
            self.scheduler.release()  # held requests run under the old version, tagged with it

    async def _swapped(self) -> None:
        """Wait for the swap of the last answered commit; SwapFailed if it failed."""
        if self._swapping is not None:
            await asyncio.wait([self._swapping])  # its `_after_swap`, added first, has run by then
        if self.broken is not None:
            raise SwapFailed(self.broken)


class Handoff:
    """Results from the scheduler thread to the event loop's futures, one loop wakeup per batch of
    them (a forward can finish dozens of requests; a wakeup each cost more than the responses)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Future, object]] = []

    def put(self, future: asyncio.Future, result) -> None:
        """From any thread: resolve `future` with `result` (an exception fails it) on the loop."""
        with self._lock:
            self._pending.append((future, result))
            first = len(self._pending) == 1
        if first:  # the drain already scheduled takes the later ones too
            self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for future, result in pending:
            _resolve(future, result)


def _resolve(future: asyncio.Future, result) -> None:
    if future.done():
        return
    if isinstance(result, Exception):
        future.set_exception(result)
    else:
        future.set_result(result)


def serve(config: EmbeddedConfig) -> None:
    """Blocking: load the model and serve until SIGINT/SIGTERM (on `config.port`, which must be set)."""
    if _has_fd(sys.stderr):  # `moe-rl stacks`: every thread's stack to the log (not in-process under pytest)
        faulthandler.register(signal.SIGUSR2, all_threads=True)
    if is_classifier(config.model_path):  # a reward model: SGLang's /classify only
        server = ClassifierServer(str(config.model_path), config.weight_version, config.device)
    else:
        server = EmbeddedServer(
            str(config.model_path), config.weight_version, config.max_batch, config.device, config.speculative_steps
        )
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its request
    web.run_app(
        server.app(), host=config.host, port=config.port, print=None, handle_signals=True, handler_cancellation=True
    )


def _has_fd(stream) -> bool:
    try:
        stream.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both of the last two
        return False
    return True
