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
With `draft=True` each rank also has a speculative draft runner (`--speculative-algorithm NEXTN`):
its own SGLang `WeightUpdater` over a stand-in draft model holding the checkpoint's MTP layer
(HF layer `num_hidden_layers`, what SGLang's NEXTN model loads), given to SGLang's manager as the
`draft_worker`, so SGLang's own fan-out decides what reaches it; `/twin/state` adds its digests.

LoRA routes (`/load_lora_adapter`, `/load_lora_adapter_from_tensors`, `/unload_lora_adapter`): the
tokenizer side is `TokenizerControlMixin`'s own load/unload methods over SGLang's `LoRARegistry`, each
rank runs `BaseTpWorker`'s LoRA methods (its payload decoded by SGLang's deserializer and flattened
bucket, `expected_checksums` checked) over `LoRAManager`'s load/validate/unload, all compiled from
SGLang's source (`sglang_oracle.extract`); stand-ins: the LoRA memory pool and the weight upload,
which records each tensor's sha256.

Observation routes for tests (not SGLang's): `GET /twin/state` (per rank: served version, paused,
session open, sha256 of each tensor), `GET /twin/log` (one entry per weight-sync or LoRA call: route,
success, the served version before and after) and `GET /twin/lora` ({"registered": the names the
registry serves, "ranks": per rank {name: {"path", "tensors": {tensor name: sha256}}}}).

A rank that dies takes the server down, as SGLang's launcher does when a scheduler exits.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
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


LORA_ROUTES = {  # path -> (SGLang request class, BaseTpWorker method: managers/tp_worker.py)
    "/load_lora_adapter": ("LoadLoRAAdapterReqInput", "load_lora_adapter"),
    "/load_lora_adapter_from_tensors": ("LoadLoRAAdapterFromTensorsReqInput", "load_lora_adapter_from_tensors"),
    "/unload_lora_adapter": ("UnloadLoRAAdapterReqInput", "unload_lora_adapter"),
}


def _lora_rank(tp_rank: int, model_dir: str):
    """One rank's LoRA path, SGLang's code: `BaseTpWorker`'s LoRA methods (payload decoding, the
    flattened bucket, `expected_checksums`) over `LoRAManager`'s load / validate / unload methods,
    compiled from SGLang's source (`sglang_oracle.extract`: their modules need GPU kernels). Stand-ins:
    the memory pool (always fits) and the weight upload (it records each tensor's sha256)."""
    import json
    import logging
    import types

    import torch
    from safetensors.torch import load_file
    from sglang.srt.lora.lora_config import LoRAConfig
    from sglang.srt.managers.io_struct import LoRAUpdateOutput
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    from tests.conformance.sglang_oracle import extract

    os.environ["HF_HUB_OFFLINE"] = "1"  # a lora_path that is no directory fails at once (no hub download)
    names = dict(
        torch=torch,
        LoRAConfig=LoRAConfig,
        LoRAUpdateOutput=LoRAUpdateOutput,
        logger=logging.getLogger("twin"),
        MultiprocessingSerializer=MultiprocessingSerializer,
        FlattenedTensorBucket=FlattenedTensorBucket,
        monkey_patch_torch_reductions=monkey_patch_torch_reductions,
        get_parallel=lambda: types.SimpleNamespace(tp_rank=tp_rank, dcp_replicate_q_proj=False),
    )
    manager = types.SimpleNamespace(
        loras={},
        configs={},
        lora_refs={},
        tensors={},
        num_pinned_loras=0,
        attn_dp_enabled=False,
        max_loras_per_batch=8,
        base_hf_config=types.SimpleNamespace(
            vocab_size=json.load(open(os.path.join(model_dir, "config.json")))["vocab_size"]
        ),
        memory_pool=types.SimpleNamespace(can_support=lambda config: True, remove_lora=lambda lora_id: None),
    )
    for method in (
        "_load_lora_adapter",
        "_load_lora_adapter_from_tensors",
        "_unload_lora_adapter",
        "validate_new_adapter",
        "create_lora_update_result",
    ):
        fn = extract("sglang.srt.lora.lora_manager", f"LoRAManager.{method}", dict(names))
        setattr(manager, method, types.MethodType(fn, manager))

    def record(lora_ref, tensors):  # stand-in for the upload into the LoRA memory pool
        manager.tensors[lora_ref.lora_id] = {name: _digest(t) for name, t in sorted(tensors.items())}
        manager.loras[lora_ref.lora_id] = lora_ref

    manager.load_lora_weights = lambda ref: record(
        ref, load_file(os.path.join(ref.lora_path, "adapter_model.safetensors"))
    )
    manager.load_lora_weights_from_tensors = record
    runner = types.SimpleNamespace(  # ModelRunner's LoRA methods call the manager (model_runner.py)
        load_lora_adapter=manager._load_lora_adapter,
        unload_lora_adapter=manager._unload_lora_adapter,
        load_lora_adapter_from_tensors=manager._load_lora_adapter_from_tensors,
    )
    worker = types.SimpleNamespace(model_runner=runner)
    for method in (
        "deserialize_own_rank",
        "load_lora_adapter",
        "unload_lora_adapter",
        "load_lora_adapter_from_tensors",
    ):
        fn = extract("sglang.srt.managers.tp_worker", f"BaseTpWorker.{method}", dict(names))
        setattr(worker, method, fn if method != "deserialize_own_rank" else types.MethodType(fn, worker))
    return manager, worker


def _lora_front(fan_out):
    """The tokenizer manager's LoRA side, SGLang's code: `TokenizerControlMixin`'s load / unload
    methods (`sglang_oracle.extract`; its module needs fastapi) over SGLang's `LoRARegistry`; the
    ranks' answers merged by SGLang's `_merge_lora_update_results`. Returns (self, methods)."""
    import logging
    import types

    from sglang.srt.lora.lora_registry import LoRARef, LoRARegistry
    from sglang.srt.managers import io_struct
    from sglang.srt.utils.common import normalize_serialized_named_tensor_payloads

    from tests.conformance.sglang_oracle import extract

    module = "sglang.srt.managers.tokenizer_control_mixin"
    names = dict(
        LoRARef=LoRARef,
        LoRAUpdateOutput=io_struct.LoRAUpdateOutput,
        logger=logging.getLogger("twin"),
        LoadLoRAAdapterReqOutput=io_struct.LoRAUpdateOutput,
        UnloadLoRAAdapterReqOutput=io_struct.LoRAUpdateOutput,
        LoadLoRAAdapterFromTensorsReqOutput=io_struct.LoRAUpdateOutput,
        UnloadLoRAAdapterReqInput=io_struct.UnloadLoRAAdapterReqInput,
        normalize_serialized_named_tensor_payloads=normalize_serialized_named_tensor_payloads,
        get_lora=lambda: types.SimpleNamespace(enable_lora=True, max_loaded_loras=None),
        get_parallel=lambda: types.SimpleNamespace(dp_size=1),
    )
    for helper in ("_merge_lora_update_results", "_lora_load_needs_cleanup"):
        names[helper] = extract(module, helper, names)

    async def communicator(obj):
        results = await fan_out(next(p for p, (cls, _) in LORA_ROUTES.items() if cls == type(obj).__name__), obj)
        return [
            io_struct.LoRAUpdateOutput(success=ok, error_message=msg[0], loaded_adapters=msg[1])
            if isinstance(msg, tuple)
            else io_struct.LoRAUpdateOutput(success=False, error_message=str(msg))
            for ok, msg, _, _ in results
        ]  # (a str: the rank raised, as a checksum mismatch does)

    front = types.SimpleNamespace(
        auto_create_handle_loop=lambda: None,
        lora_update_lock=asyncio.Lock(),
        pending_lora_unloads={},
        lora_registry=LoRARegistry(),
        lora_ref_cache={},
        update_lora_adapter_communicator=communicator,
    )
    for method in (
        "load_lora_adapter",
        "load_lora_adapter_from_tensors",
        "unload_lora_adapter",
        "_unload_lora_adapter_locked",
    ):
        fn = extract(module, f"TokenizerControlMixin.{method}", names)
        setattr(front, method, types.MethodType(fn, front))
    return front


# -- one TP rank (SGLang's scheduler process) -------------------------------------------------------


def _rank_main(
    tp_rank: int, tp_size: int, tp_port: int, model_dir: str, version: str, running_requests: int, draft: bool, conn
) -> None:
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
    server_args = ServerArgs(
        model_path=model_dir, tp_size=tp_size, device="cpu", skip_tokenizer_init=True, weight_version=version
    )
    runtime_context.publish(server_args, role="scheduler")

    class Model(torch.nn.Module):  # stand-in: full tensors on every rank, loaded in place
        def __init__(self, tensors):
            super().__init__()
            self.tensors = {name: t.clone() for name, t in tensors.items()}

        def load_weights(self, named_tensors):
            for name, tensor in named_tensors:
                self.tensors[name].copy_(tensor)  # in place, as SGLang's weight loaders do

    class DraftModel(Model):  # stand-in for SGLang's NEXTN model: only the MTP layer's tensors
        def load_weights(self, named_tensors):
            super().load_weights((name, t) for name, t in named_tensors if name in self.tensors)

    def updater_of(model, get_runner) -> WeightUpdater:
        return WeightUpdater(
            tp_rank=tp_rank,
            device="cpu",
            gpu_id=0,
            model_config=None,
            custom_weight_loaders={},
            get_model=lambda: model,
            update_model_fields=lambda *a, **k: None,
            recapture_cuda_graph=lambda: None,
            get_model_runner=get_runner,
        )

    @dataclass
    class Runner:  # stand-in for ModelRunner: what the weight managers reach through it
        weight_updater: WeightUpdater

    tensors = load_file(os.path.join(model_dir, "model.safetensors"))
    model = Model(tensors)
    updater = updater_of(model, lambda: runner)
    runner = Runner(updater)
    draft_model = draft_runner = None
    if draft:
        with open(os.path.join(model_dir, "config.json")) as file:
            mtp = f"model.layers.{json.load(file)['num_hidden_layers']}."
        draft_model = DraftModel({n: t for n, t in tensors.items() if n.startswith(mtp)})
        draft_runner = Runner(updater_of(draft_model, lambda: draft_runner))

    class DraftWorker:  # stand-in for the EAGLE/NEXTN draft worker: its weight-update runner
        def weight_update_runners(self):
            return [("draft", draft_runner)]

    class Worker:  # stand-in for TpModelWorker (managers/tp_worker.py, whose module needs GPU kernels)
        model_runner = runner

        def init_weights_update_group(self, req):  # TpModelWorker.init_weights_update_group
            return updater.init_weights_update_group(
                req.master_address, req.master_port, req.rank_offset, req.world_size, req.group_name, req.backend
            )

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

    manager = Manager(
        tp_worker=Worker(),
        draft_worker=DraftWorker() if draft else None,
        memory_saver_adapter=None,
        flush_cache=flush_cache,
        is_fully_idle=lambda **k: True,
        scheduler=SchedulerStandIn(),
    )

    def served() -> str:
        return runtime_context.get_serving().weight_version

    lora_manager, lora_worker = _lora_rank(tp_rank, model_dir)

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
        if route in LORA_ROUTES:
            out = getattr(lora_worker, LORA_ROUTES[route][1])(lora_worker, req)
            return out.success, (out.error_message, out.loaded_adapters)
        if route == "/twin/lora":
            return True, {
                ref.lora_name: {"path": ref.lora_path, "tensors": lora_manager.tensors[lora_id]}
                for lora_id, ref in lora_manager.lora_refs.items()
            }
        if route == "/twin/state":
            return True, {
                "version": served(),
                "paused": state["paused"],
                "session": manager._session is not None,
                "weights": {n: _digest(t) for n, t in model.tensors.items()},
                "draft_weights": {n: _digest(t) for n, t in draft_model.tensors.items()} if draft else None,
            }
        method = {
            "/init_weights_update_group": manager.init_weights_update_group,
            "/destroy_weights_update_group": manager.destroy_weights_update_group,
            "/begin_weight_update": manager.begin_weight_update,
            "/end_weight_update": manager.end_weight_update,
            "/update_weights_from_distributed": manager.update_weights_from_distributed,
        }[route]
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


def _server_main(port: int, tp_size: int, model_dir: str, version: str, running_requests: int, draft: bool) -> None:
    from tests.conformance import sglang_oracle

    sglang_oracle.install()
    import msgspec
    import pydantic
    from aiohttp import web
    from sglang.srt.managers import io_struct
    from sglang.srt.managers.communicator import FanOutCommunicator
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.common import build_server_info
    from sglang.srt.utils.msgspec_utils import msgspec_to_builtins

    ctx = mp.get_context("spawn")
    tp_port, conns, ranks = _free_port(), [], []
    for tp_rank in range(tp_size):
        parent, child = ctx.Pipe()
        rank = ctx.Process(
            target=_rank_main,
            daemon=True,
            args=(tp_rank, tp_size, tp_port, model_dir, version, running_requests, draft, child),
        )
        rank.start()
        child.close()  # so a rank's death is an EOF here
        conns.append(parent)
        ranks.append(rank)
    for conn in conns:
        assert conn.recv() == "ready"
    server_args = ServerArgs(
        model_path=model_dir, tp_size=tp_size, device="cpu", skip_tokenizer_init=True, weight_version=version
    )
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
            [type("Out", (), {"success": ok, "message": str(msg)}) for ok, msg, _, _ in results]
        )
        log.append(
            {
                "route": route,
                "success": success,
                "message": message,
                "weight_version": body.get("weight_version"),
                "before": [r[2] for r in results],
                "after": [r[3] for r in results],
                "time": time.time(),
            }
        )
        return web.json_response({"success": success, "message": message}, status=200 if success else 400)

    lora_front = None

    async def lora_route(http: web.Request) -> web.Response:
        """SGLang's LoRA handlers (http_server.py): 200 when success, else 400; LoRAUpdateOutput body."""
        nonlocal lora_front
        if lora_front is None:
            lora_front = _lora_front(fan_out_locked)
        route, body = http.path, await http.json()
        cls = getattr(io_struct, LORA_ROUTES[route][0])
        try:
            unknown = set(body) - set(cls.__struct_fields__) - INTERNAL_FIELDS
            if unknown:
                raise ValueError(f"{route}: {sorted(unknown)} are not fields of SGLang's {cls.__name__}")
            req = pydantic.TypeAdapter(cls).validate_python(body)
        except (ValueError, pydantic.ValidationError) as error:
            log.append({"route": route, "success": False, "message": str(error)})
            return web.json_response({"detail": str(error)}, status=422)
        method = {
            "/load_lora_adapter": "load_lora_adapter",
            "/unload_lora_adapter": "unload_lora_adapter",
            "/load_lora_adapter_from_tensors": "load_lora_adapter_from_tensors",
        }[route]
        result = await getattr(lora_front, method)(req)
        log.append({"route": route, "success": result.success, "message": result.error_message, "time": time.time()})
        return web.json_response(msgspec_to_builtins(result), status=200 if result.success else 400)

    async def fan_out_locked(route: str, req) -> list:
        async with lock:
            return await fan_out(route, req)

    async def twin_lora(http: web.Request) -> web.Response:
        """The registry's adapters (names SGLang serves) and, per rank, each adapter's tensors' sha256."""
        registered = sorted(lora_front.lora_registry._registry) if lora_front else []
        async with lock:
            ranks = [r[1] for r in await fan_out("/twin/lora", None)]
        return web.json_response({"registered": registered, "ranks": ranks})

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
    for route in LORA_ROUTES:
        app.router.add_post(route, lora_route)
    app.router.add_route("*", "/flush_cache", flush_cache)
    for path, handler in {
        "/server_info": server_info,
        "/get_server_info": server_info,
        "/health": health,
        "/twin/state": twin_state,
        "/twin/log": twin_log,
        "/twin/ranks": twin_ranks,
        "/twin/lora": twin_lora,
    }.items():
        app.router.add_get(path, handler)
    web.run_app(app, host="127.0.0.1", port=port, print=None, handle_signals=True)


class SGLangTwin:
    """Starts a twin (`tp_size` rank processes + the HTTP process) serving `model_dir` (an HF
    directory with one `model.safetensors`: the initial weights, as `version`). A context manager."""

    def __init__(
        self, model_dir: str, tp_size: int = 2, version: str = "0", running_requests: int = 0, draft: bool = False
    ):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = mp.get_context("spawn").Process(
            target=_server_main, args=(self.port, tp_size, model_dir, version, running_requests, draft)
        )

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
