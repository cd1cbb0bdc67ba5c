"""FAKE engine for sync tests: a real aiohttp server in its own process, SGLang's weight routes,
a real `WeightReceiver` in a real process group, but no model and no generation.

`FakeEngineServer` serves a dict of tensors (the "model") and its version; `/debug_dump_weights`
(test-only) writes them to a safetensors file so a test can compare them exactly.
`FakeEngineClient` implements `sync.engine_api.EngineEndpoint` over HTTP (the real client lives
in `moe_rl.engine`; sync's tests must not import moe_rl). `die_at=(version, k)` makes the server
SIGKILL itself when bucket k of that version is announced: an engine killed in mid-sync.
"""

from __future__ import annotations

import asyncio
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import torch
import torch.multiprocessing as mp
from aiohttp import web
from safetensors.torch import save_file

from sync.receiver import WeightReceiver


def _serve(ports, die_at: tuple[int, int] | None, timeout_s: float) -> None:
    torch.set_num_threads(1)
    receiver = WeightReceiver("cpu")
    weights: dict[str, torch.Tensor] = {}
    pool = ThreadPoolExecutor(4)  # collectives block: keep them off the event loop (the receiver orders them)
    buckets: dict[int, int] = {}  # version -> buckets announced
    session = {"open": False}  # SGLang's rule: bucket routes only inside begin ... end

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
        await blocking(
            receiver.join,
            b["master_address"],
            b["master_port"],
            b["rank_offset"],
            b["world_size"],
            b["group_name"],
            b["backend"],
            timeout_s,
        )

    async def destroy_group(b):
        await blocking(receiver.leave, b.get("group_name"))

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
        if die_at == (version, buckets.get(version, 0)):
            os.kill(os.getpid(), signal.SIGKILL)
        buckets[version] = buckets.get(version, 0) + 1
        await blocking(
            receiver.receive_bucket,
            b["names"],
            b["dtypes"],
            b["shapes"],
            b.get("weight_version"),
            b.get("checksum"),
            b["group_name"],
        )

    async def update_disk(b):
        await blocking(receiver.stage_from_disk, b["model_path"], b["weight_version"])

    async def update_version(b):
        weights.update(await blocking(receiver.commit, b["new_version"]))
        return {"new_version": b["new_version"]}

    async def pause(b):  # nothing to pause: the fake engine does not generate
        pass

    async def resume(b):
        receiver.abort()

    async def flush(b):
        pass

    async def model_info(b):
        return {"weight_version": str(receiver.version)}

    async def server_info(b):
        return {"tp_size": 1, "dp_size": 1}

    async def dump(b):
        save_file({k: v.contiguous() for k, v in weights.items()}, b["path"])

    app = web.Application(client_max_size=1 << 30)
    for path, fn in {
        "/init_weights_update_group": init_group,
        "/destroy_weights_update_group": destroy_group,
        "/update_weights_from_distributed": update_distributed,
        "/update_weights_from_disk": update_disk,
        "/update_weight_version": update_version,
        "/pause_generation": pause,
        "/continue_generation": resume,
        "/flush_cache": flush,
        "/model_info": model_info,
        "/server_info": server_info,
        "/health": flush,
        "/begin_weight_update": begin,
        "/end_weight_update": end,
        "/debug_dump_weights": dump,
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


def start_engine(die_at: tuple[int, int] | None = None, timeout_s: float = 30) -> tuple[mp.Process, int]:
    """Start a fake engine process; returns it and its HTTP port once it listens."""
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    proc = ctx.Process(target=_serve, args=(ports, die_at, timeout_s), daemon=True)
    proc.start()
    try:
        return proc, ports.get(timeout=60)
    except Exception:
        proc.kill()
        raise RuntimeError("fake engine did not start within 60 s") from None


async def _post(url: str, body: dict, timeout_s: float = 60) -> dict:
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.post(url, json=body) as response:
            payload = await response.json()
            if response.status != 200 or not payload.get("success", True):
                raise RuntimeError(payload.get("message", f"HTTP {response.status}"))
            return payload


class FakeEngineClient:
    """EngineEndpoint over HTTP for the fake engine (one rank in the weight-update group)."""

    def __init__(self, port: int, name: str | None = None, timeout_s: float = 60):
        self.url = f"http://127.0.0.1:{port}"
        self.name = name or f"fake-engine@{port}"
        self.timeout_s = timeout_s
        self.verifies_checksums = True  # the fake engine's receiver is the embedded engine's

    async def _call(self, route: str, **body) -> dict:
        return await _post(self.url + route, body, self.timeout_s)

    async def num_group_ranks(self) -> int:
        return (await self._call("/server_info"))["tp_size"]

    async def health(self) -> bool:
        try:
            await _post(self.url + "/health", {}, 5)
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

    # test-only helpers (synchronous)
    def served_version(self) -> int:
        return int(asyncio.run(self._call("/model_info"))["weight_version"])

    def dump_weights(self, path: str) -> None:
        asyncio.run(self._call("/debug_dump_weights", path=path))
