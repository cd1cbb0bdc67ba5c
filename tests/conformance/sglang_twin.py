"""SGLang twin: a TEST FIXTURE that serves SGLang 0.5.23's weight-sync routes with SGLang's own code.

Not a product engine: it has no model forward and no generation. It exists so the project's client
and `WeightSender` can be tested against what SGLang really does when it receives weights, on CPU.

Processes, as in SGLang: one HTTP front end (SGLang's tokenizer manager) and one process per TP
rank (SGLang's schedulers), the ranks joined in their own gloo world (SGLang's TP group). What
comes from SGLang's modules (`tests.conformance.sglang_oracle` makes them importable):
- every request body is parsed into SGLang's request class (`managers/io_struct.py`); a field the
  class does not have is refused (SGLang's HTTP layer would drop it silently: a client bug);
- results of all ranks are merged with `FanOutCommunicator.merge_results` (all must succeed);
- each rank runs SGLang's `SchedulerWeightUpdaterManager` (the session rules, the served version
  recorded from a bucket's `weight_version`, the post-load flush) over SGLang's model-runner
  `WeightUpdater` (`init_weights_update_group` through `init_custom_process_group` at
  `rank_offset + tp_rank`, buckets rebuilt by `FlattenedTensorBucket`, loaded in place with the
  model's `load_weights`), and the served version lives in SGLang's runtime context (`publish`
  of a `ServerArgs`);
- `/server_info` is SGLang's `build_server_info(server_args, ...)`.
Stand-ins (named so), where SGLang's module cannot be imported without GPU kernels: the model is
a dict of CPU tensors with a `load_weights` that copies in place (each rank holds full tensors);
`TpModelWorker`'s three weight methods and `Scheduler.record_weight_version_change` are restated
from SGLang's source (a few lines each); the scheduler has no requests except `running_requests`
(a knob: requests an in_place pause leaves in the running batch, which make SGLang refuse a flush).

Observation routes for tests (not SGLang's): `GET /twin/state` (per rank: served version, paused,
session open, sha256 of each tensor) and `GET /twin/log` (one entry per weight-sync call: route,
success, the served version before and after).

A rank that dies takes the server down, as SGLang's launcher does when a scheduler exits.
"""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing as mp
import os
import socket
import time
from dataclasses import dataclass

ROUTES = {  # path -> SGLang request class (io_struct)
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/update_weight_version": "UpdateWeightVersionReqInput",
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
}
INTERNAL_FIELDS = {"http_worker_ipc"}  # BaseReq's IPC routing field, set by SGLang itself


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _digest(tensor) -> str:
    return hashlib.sha256(tensor.contiguous().view(-1).view(dtype=__import__("torch").uint8).numpy()).hexdigest()


# -- one TP rank (SGLang's scheduler process) -------------------------------------------------------

def _rank_main(tp_rank: int, tp_size: int, tp_port: int, model_dir: str, version: str,
               running_requests: int, conn) -> None:
    from tests.conformance import sglang_oracle

    sglang_oracle.install()
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from sglang.srt import runtime_context
    from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
    from sglang.srt.server_args import ServerArgs

    torch.set_num_threads(1)
    # SGLang's TP group; its weight updater asserts a default process group exists
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{tp_port}", rank=tp_rank, world_size=tp_size)
    server_args = ServerArgs(model_path=model_dir, tp_size=tp_size, device="cpu",
                             skip_tokenizer_init=True, weight_version=version)
    runtime_context.publish(server_args, role="scheduler")

    class Model(torch.nn.Module):  # stand-in: full tensors on every rank, loaded in place
        def __init__(self, tensors):
            super().__init__()
            self.tensors = {name: t.clone() for name, t in tensors.items()}

        def load_weights(self, named_tensors):
            for name, tensor in named_tensors:
                self.tensors[name].copy_(tensor)  # in place, as SGLang's weight loaders do

    model = Model(load_file(os.path.join(model_dir, "model.safetensors")))
    updater = WeightUpdater(tp_rank=tp_rank, device="cpu", gpu_id=0, model_config=None, custom_weight_loaders={},
                            get_model=lambda: model, update_model_fields=lambda *a, **k: None,
                            recapture_cuda_graph=lambda: None, get_model_runner=lambda: runner)

    @dataclass
    class Runner:  # stand-in for ModelRunner: what the weight managers reach through it
        weight_updater: WeightUpdater

    runner = Runner(updater)

    class Worker:  # stand-in for TpModelWorker (managers/tp_worker.py, whose module needs GPU kernels)
        model_runner = runner

        def init_weights_update_group(self, req):  # TpModelWorker.init_weights_update_group
            return updater.init_weights_update_group(req.master_address, req.master_port, req.rank_offset,
                                                     req.world_size, req.group_name, req.backend)

        def destroy_weights_update_group(self, req):
            return updater.destroy_weights_update_group(req.group_name)

        def weight_update_runners(self):
            return [("target", runner)]

    state = {"paused": None}

    class SchedulerStandIn:  # stand-in for Scheduler (managers/scheduler.py needs GPU kernels to import)
        def record_weight_version_change(self, new_version):  # Scheduler.record_weight_version_change
            if new_version is None or new_version == runtime_context.get_serving().weight_version:
                return
            runtime_context.get_context().override("scheduler.weight_version", weight_version=new_version)

        def handle_update_weight_version(self, req):  # Scheduler.handle_update_weight_version
            self.record_weight_version_change(new_version=req.new_version)

    def flush_cache(empty_cache=True) -> bool:  # SGLang's is_fully_idle(ignore_waiting=paused)
        return not (running_requests and state["paused"] == "in_place")

    class Manager(SchedulerWeightUpdaterManager):
        def __post_init__(self):
            self.tp_cpu_group = dist.group.WORLD

    manager = Manager(tp_worker=Worker(), draft_worker=None, memory_saver_adapter=None,
                      flush_cache=flush_cache, is_fully_idle=lambda **k: True, scheduler=SchedulerStandIn())

    def served() -> str:
        return runtime_context.get_serving().weight_version

    def handle(route: str, req):
        if route == "/pause_generation":
            state["paused"] = req.mode
            return True, "paused"
        if route == "/continue_generation":
            state["paused"] = None
            return True, "continued"
        if route == "/update_weight_version":
            manager.scheduler.handle_update_weight_version(req)
            return True, "ok"
        if route == "/twin/state":
            return True, {"version": served(), "paused": state["paused"], "session": manager._session is not None,
                          "weights": {n: _digest(t) for n, t in model.tensors.items()}}
        method = {"/init_weights_update_group": manager.init_weights_update_group,
                  "/destroy_weights_update_group": manager.destroy_weights_update_group,
                  "/begin_weight_update": manager.begin_weight_update,
                  "/end_weight_update": manager.end_weight_update,
                  "/update_weights_from_distributed": manager.update_weights_from_distributed}[route]
        out = method(req)
        return out.success, out.message

    conn.send("ready")
    while True:
        message = conn.recv()
        if message is None:
            return
        route, req = message
        before = served()
        try:
            success, result = handle(route, req)
        except Exception as error:  # noqa: BLE001 - SGLang would log it; the call fails
            success, result = False, f"{type(error).__name__}: {error}"
        conn.send((success, result, before, served()))


# -- the HTTP front end (SGLang's http_server + tokenizer manager) ----------------------------------

def _server_main(port: int, tp_size: int, model_dir: str, version: str, running_requests: int) -> None:
    from tests.conformance import sglang_oracle

    sglang_oracle.install()
    import msgspec
    import pydantic
    from aiohttp import web

    from sglang.srt.managers import io_struct
    from sglang.srt.managers.communicator import FanOutCommunicator
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.common import build_server_info

    ctx = mp.get_context("spawn")
    tp_port, conns, ranks = _free_port(), [], []
    for tp_rank in range(tp_size):
        parent, child = ctx.Pipe()
        rank = ctx.Process(target=_rank_main, daemon=True,
                           args=(tp_rank, tp_size, tp_port, model_dir, version, running_requests, child))
        rank.start()
        child.close()  # so a rank's death is an EOF here
        conns.append(parent)
        ranks.append(rank)
    for conn in conns:
        assert conn.recv() == "ready"
    server_args = ServerArgs(model_path=model_dir, tp_size=tp_size, device="cpu",
                             skip_tokenizer_init=True, weight_version=version)
    log: list[dict] = []
    lock = asyncio.Lock()

    def ask(conn, message):
        try:
            conn.send(message)
            return conn.recv()
        except (EOFError, OSError):  # a scheduler died: SGLang's server goes down with it
            for rank in ranks:
                rank.kill()
            os._exit(1)

    async def fan_out(route: str, req) -> list:
        return await asyncio.gather(*[asyncio.to_thread(ask, conn, (route, req)) for conn in conns])

    def parse(route: str, body: dict):
        """As SGLang's FastAPI layer does (the class's pydantic core schema, which ignores unknown
        fields: the twin refuses them instead, since SGLang would drop them without a word)."""
        cls = getattr(io_struct, ROUTES[route])
        unknown = set(body) - set(cls.__struct_fields__) - INTERNAL_FIELDS
        if unknown:
            raise ValueError(f"{route}: {sorted(unknown)} are not fields of SGLang's {cls.__name__}")
        return pydantic.TypeAdapter(cls).validate_python(body)

    async def weight_route(http: web.Request) -> web.Response:
        route = http.path
        body = await http.json() if http.can_read_body else {}
        try:
            req = parse(route, body)
        except (ValueError, pydantic.ValidationError) as error:
            log.append({"route": route, "success": False, "message": str(error)})
            return web.json_response({"detail": str(error)}, status=422)
        async with lock:  # a scheduler takes one request at a time, in arrival order
            results = await fan_out(route, req)
        success, message = FanOutCommunicator.merge_results(
            [type("Out", (), {"success": ok, "message": str(msg)}) for ok, msg, _, _ in results])
        log.append({"route": route, "success": success, "message": message, "weight_version": body.get("weight_version"),
                    "before": [r[2] for r in results], "after": [r[3] for r in results], "time": time.time()})
        return web.json_response({"success": success, "message": message}, status=200 if success else 400)

    async def flush_cache(http: web.Request) -> web.Response:
        async with lock:
            results = await fan_out("/twin/state", None)
        refused = running_requests and any(r[1]["paused"] == "in_place" for r in results)
        log.append({"route": "/flush_cache", "success": not refused})
        if refused:
            return web.Response(status=400, text="Flush cache failed: requests are running.\n")
        return web.Response(status=200, text="Cache flushed.\n")

    async def server_info(http: web.Request) -> web.Response:
        info = build_server_info(server_args, {})
        return web.json_response(msgspec.to_builtins(info), dumps=lambda v: msgspec.json.encode(v).decode())

    async def health(http: web.Request) -> web.Response:
        return web.Response(status=200)

    async def twin_state(http: web.Request) -> web.Response:
        async with lock:
            return web.json_response([r[1] for r in await fan_out("/twin/state", None)])

    async def twin_log(http: web.Request) -> web.Response:
        return web.json_response(log)

    async def twin_ranks(http: web.Request) -> web.Response:
        return web.json_response([rank.pid for rank in ranks])

    app = web.Application(client_max_size=1 << 30)
    for route in ROUTES:
        app.router.add_post(route, weight_route)
    app.router.add_route("*", "/flush_cache", flush_cache)
    for path, handler in {"/server_info": server_info, "/get_server_info": server_info, "/health": health,
                          "/twin/state": twin_state, "/twin/log": twin_log, "/twin/ranks": twin_ranks}.items():
        app.router.add_get(path, handler)
    web.run_app(app, host="127.0.0.1", port=port, print=None, handle_signals=True)


class SGLangTwin:
    """Starts a twin (`tp_size` rank processes + the HTTP process) serving `model_dir` (an HF
    directory with one `model.safetensors`: the initial weights, as `version`). A context manager."""

    def __init__(self, model_dir: str, tp_size: int = 2, version: str = "0", running_requests: int = 0):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = mp.get_context("spawn").Process(
            target=_server_main, args=(self.port, tp_size, model_dir, version, running_requests))

    def start(self) -> "SGLangTwin":
        self.process.start()
        return self

    def wait_ready(self, timeout_s: float = 300) -> "SGLangTwin":
        import requests

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.process.is_alive():
                raise RuntimeError(f"the SGLang twin exited with code {self.process.exitcode}")
            try:
                if requests.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise TimeoutError("the SGLang twin did not answer /health")

    def get(self, path: str):
        import requests

        response = requests.get(self.url + path, timeout=30)
        response.raise_for_status()
        return response.json()

    def state(self) -> list[dict]:
        return self.get("/twin/state")

    def log(self) -> list[dict]:
        return self.get("/twin/log")

    def stop(self) -> None:
        if self.process.is_alive():
            for pid in self.get("/twin/ranks"):
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
            self.process.kill()
        self.process.join(10)

    def __enter__(self):
        return self.start().wait_ready()

    def __exit__(self, *exc):
        self.stop()
