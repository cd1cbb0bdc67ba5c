"""A receiver-only engine: a `WeightReceiver` behind SGLang's weight routes, no model, no generation.

What `moe-rl bench sync` and the sync tests drive: a real aiohttp server in its own process, a
real `WeightReceiver` in the real weight-update groups, so a sync costs what it costs an engine
to receive, check and stage the bytes, and nothing of model loading (the embedded engine's
commit rebuilds a transformers model).

    proc, port = start_receiver_engine()
    engine = ReceiverEngineClient(port, name="engine-0")       # a sync.engine_api.EngineEndpoint
    ...                                                        # any Syncer sends to it
    engine.served_version(); engine.dump_weights(path)         # what it serves, exactly

Routes: SGLang's weight routes, session rule included (`/update_weights_from_distributed` only
between `/begin_weight_update` and `/end_weight_update`), `/model_info` and `/server_info`
(tp_size 1), and `/debug/*` for measurement: `dump_weights` (the served tensors as safetensors),
`cpu` (the process's CPU seconds so far), `traffic` (`sync.traffic` bytes received so far),
`raw_receive` (one broadcast into a buffer kept per size: a raw broadcast's best case).
`fail_at=(version, k)` makes the process SIGKILL itself when bucket k of that version is
announced: an engine that dies mid-sync, for the failure tests. Blocking calls run on a pool of
threads (collectives block; the receiver orders them); each call's failure comes back as
SGLang's (HTTP 400, success false, the message).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import torch
import torch.multiprocessing as mp
from aiohttp import web
from safetensors.torch import save_file

from sync import traffic
from sync.delta import DELTA_LOAD_FORMAT
from sync.receiver import WeightReceiver


def _serve(ports, fail_at: tuple[int, int] | None, timeout_s: float) -> None:
    torch.set_num_threads(1)
    receiver = WeightReceiver("cpu")
    weights: dict[str, torch.Tensor] = {}  # the served tensors (views the receiver keeps)
    raw: dict[int, torch.Tensor] = {}  # raw_receive's buffers, by size
    pool = ThreadPoolExecutor(8)
    buckets: dict[int, int] = {}  # version -> buckets announced
    session = {"open": False}

    async def blocking(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    def route(fn):
        async def handler(request: web.Request) -> web.Response:
            body = await request.json() if request.can_read_body else {}
            try:
                result = await fn(body)
            except Exception as error:  # SGLang's shape: success false + message, HTTP 400
                return web.json_response({"success": False, "message": f"{type(error).__name__}: {error}"}, status=400)
            return web.json_response({"success": True, "message": "", **(result or {})})

        return handler

    async def init_group(b):
        keys = ("master_address", "master_port", "rank_offset", "world_size", "group_name", "backend")
        await blocking(receiver.join, *(b[key] for key in keys), timeout_s)

    async def begin(b):
        if session["open"]:
            raise RuntimeError("a weight-update session is already open")
        receiver.begin()
        session["open"] = True

    async def end(b):
        if not session["open"]:
            raise RuntimeError("no weight-update session is open")
        session["open"] = False

    async def update_distributed(b):
        if not session["open"]:
            raise RuntimeError("update_weights_from_distributed must run between begin and end")
        version = receiver.version + 1  # buckets name no version: the next one is on its way
        if fail_at == (version, buckets.get(version, 0)):
            os.kill(os.getpid(), signal.SIGKILL)
        buckets[version] = buckets.get(version, 0) + 1
        keys = ("names", "dtypes", "shapes", "weight_version", "checksum", "group_name")
        delta = b.get("load_format") == DELTA_LOAD_FORMAT
        await blocking(receiver.receive_bucket, *(b.get(key) for key in keys), delta)

    async def update_version(b):
        weights.update(await blocking(receiver.commit, b["new_version"]))
        return {"new_version": b["new_version"]}

    async def nothing(b):  # pause, flush, health: nothing generates here
        pass

    async def resume(b):
        receiver.abort()

    async def leave(b):
        await blocking(receiver.leave, b.get("group_name"))

    async def update_disk(b):
        await blocking(receiver.stage_from_disk, b["model_path"], b["weight_version"])

    async def model_info(b):
        return {"weight_version": str(receiver.version)}

    async def server_info(b):
        return {"tp_size": 1, "dp_size": 1}

    async def dump_weights(b):
        await blocking(save_file, {k: v.contiguous() for k, v in weights.items()}, b["path"])

    async def cpu(b):
        return {"seconds": time.process_time()}

    async def received(b):
        return traffic.snapshot()

    def broadcast_raw(nbytes: int, group_name: str) -> None:
        buffer = raw.setdefault(nbytes, torch.empty(nbytes, dtype=torch.uint8))  # preallocated once
        receiver.groups[group_name].broadcast(buffer)

    async def raw_receive(b):
        await blocking(broadcast_raw, b["nbytes"], b["group_name"])

    app = web.Application(client_max_size=1 << 30)
    for path, fn in {
        "/init_weights_update_group": init_group,
        "/destroy_weights_update_group": leave,
        "/begin_weight_update": begin,
        "/end_weight_update": end,
        "/update_weights_from_distributed": update_distributed,
        "/update_weights_from_disk": update_disk,
        "/update_weight_version": update_version,
        "/pause_generation": nothing,
        "/continue_generation": resume,
        "/flush_cache": nothing,
        "/health": nothing,
        "/model_info": model_info,
        "/server_info": server_info,
        "/debug/dump_weights": dump_weights,
        "/debug/cpu": cpu,
        "/debug/traffic": received,
        "/debug/raw_receive": raw_receive,
    }.items():
        app.router.add_post(path, route(fn))

    async def main():
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)  # the OS picks the port: no race
        await site.start()
        ports.put(site._server.sockets[0].getsockname()[1])
        await asyncio.Event().wait()

    asyncio.run(main())


def start_receiver_engine(fail_at: tuple[int, int] | None = None, timeout_s: float = 30) -> tuple[mp.Process, int]:
    """Start a receiver-only engine process; returns it and its HTTP port once it listens.
    `timeout_s` bounds its collectives. The caller kills the process when done."""
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    proc = ctx.Process(target=_serve, args=(ports, fail_at, timeout_s), daemon=True)
    proc.start()
    try:
        return proc, ports.get(timeout=60)
    except Exception:
        proc.kill()
        raise RuntimeError("the receiver engine did not start within 60 s") from None


class ReceiverEngineClient:
    """`sync.engine_api.EngineEndpoint` of a receiver-only engine over HTTP (one rank in each
    weight-update group), with its `/debug` calls."""

    def __init__(self, port: int, name: str | None = None, timeout_s: float = 60):
        self.url = f"http://127.0.0.1:{port}"
        self.name = name or f"receiver-engine@{port}"
        self.timeout_s = timeout_s
        self.verifies_checksums = True  # its WeightReceiver checks every bucket's CRC-32
        self.applies_deltas = True  # and applies delta buckets (`sync.delta`)
        self.stages_versions = True  # the receiver stages a version beside the served one

    async def _call(self, route: str, timeout_s: float | None = None, **body) -> dict:
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.post(self.url + route, json=body) as response:
                payload = await response.json()
                if response.status != 200 or not payload.get("success", True):
                    raise RuntimeError(payload.get("message", f"HTTP {response.status}"))
                return payload

    async def num_group_ranks(self) -> int:
        return (await self._call("/server_info"))["tp_size"]

    async def health(self) -> bool:
        try:
            await self._call("/health", timeout_s=5)
            return True
        except Exception:  # noqa: BLE001 - no answer: dead
            return False

    async def begin_weight_update(self):
        await self._call("/begin_weight_update")

    async def end_weight_update(self):
        await self._call("/end_weight_update")

    async def init_weights_update_group(
        self, master_address, master_port, rank_offset, world_size, group_name, backend
    ):
        await self._call(
            "/init_weights_update_group",
            master_address=master_address,
            master_port=master_port,
            rank_offset=rank_offset,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
        )

    async def destroy_weights_update_group(self, group_name):
        await self._call("/destroy_weights_update_group", group_name=group_name)

    async def update_weights_from_distributed(
        self, names, dtypes, shapes, group_name, weight_version, load_format, checksum
    ):
        await self._call(
            "/update_weights_from_distributed",
            names=names,
            dtypes=dtypes,
            shapes=shapes,
            group_name=group_name,
            weight_version=weight_version,
            load_format=load_format,
            checksum=checksum,
        )

    async def update_weights_from_disk(self, model_path, weight_version):
        await self._call("/update_weights_from_disk", model_path=model_path, weight_version=weight_version)

    async def update_weight_version(self, new_version):
        await self._call("/update_weight_version", new_version=new_version)

    async def pause_generation(self, mode):
        await self._call("/pause_generation", mode=mode)

    async def continue_generation(self):
        await self._call("/continue_generation")

    async def flush_cache(self):
        await self._call("/flush_cache")

    async def raw_receive(self, nbytes: int, group_name: str) -> None:
        """Take part in one raw broadcast of `nbytes` over `group_name` (the sender broadcasts it)."""
        await self._call("/debug/raw_receive", nbytes=nbytes, group_name=group_name)

    # synchronous calls, for tests and the bench's accounting
    def served_version(self) -> int:
        return int(asyncio.run(self._call("/model_info"))["weight_version"])

    def dump_weights(self, path: str) -> None:
        asyncio.run(self._call("/debug/dump_weights", path=path))

    def cpu_seconds(self) -> float:
        """The engine process's CPU seconds so far (every thread)."""
        return asyncio.run(self._call("/debug/cpu"))["seconds"]

    def traffic(self) -> dict[str, dict[str, int]]:
        """`sync.traffic.snapshot()` of the engine process: the bytes it received so far, per link."""
        payload = asyncio.run(self._call("/debug/traffic"))
        return {way: payload[way] for way in ("sent", "received")}
