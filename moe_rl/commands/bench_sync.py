"""`moe-rl bench sync CONFIG`: full weight sync vs a raw broadcast of the same bytes, one run.

Full = stream the weights (here: a random Qwen3-MoE state dict held in memory, iterated as
`(name, tensor)`; the Megatron export is not wired in yet) + pack + broadcast + engines verify,
stage and commit (`WeightReceiver` in separate processes, driven over pipes: receivers without
a model). Raw = one flat uint8 tensor of the same byte count broadcast over the same group.
Both are warmed up once, then timed. Prints bytes, seconds, GB/s, ratio raw/full (time), and
the source rank's peak extra memory (bucket buffers + any tensor larger than a bucket).

CONFIG (YAML): `model` (Qwen3MoeConfig fields), `dtype` (bfloat16), `bucket_mb` (256),
`num_engines` (2), `output` (JSON path, default bench_sync.json).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
import yaml

from sync.receiver import WeightReceiver
from sync.sender import SyncConfig, WeightSender

COMMAND = ("bench", "sync")
HELP = "Benchmark the weight sync (full pipeline) against a raw broadcast of the same bytes."


def add_arguments(parser) -> None:
    parser.add_argument("config", help="YAML: model (Qwen3MoeConfig fields), dtype, bucket_mb, num_engines, output")


def _receiver_main(conn) -> None:
    """Bench receiver process: executes WeightReceiver calls sent over `conn` (no model)."""
    torch.set_num_threads(1)
    receiver = WeightReceiver("cpu")
    raw = torch.empty(0, dtype=torch.uint8)  # preallocated after the warm-up: raw's best case
    while True:
        method, kwargs = conn.recv()
        try:
            if method == "raw_receive":
                if raw.numel() != kwargs["nbytes"]:
                    raw = torch.empty(kwargs["nbytes"], dtype=torch.uint8)
                receiver.group.broadcast(raw)
                result = None
            elif method == "stop":
                receiver.leave()
                conn.send(("ok", None))
                return
            else:
                result = getattr(receiver, method)(**kwargs)
                result = None if method != "commit" else len(result)
            conn.send(("ok", result))
        except Exception as error:  # reported to the sender, which names this engine
            conn.send(("error", f"{type(error).__name__}: {error}"))


class PipeEngine:
    """EngineEndpoint for a bench receiver process: each call is one request over a pipe."""

    num_group_ranks = 1

    def __init__(self, name: str):
        self.name = name
        self._conn, child = mp.get_context("spawn").Pipe()
        self.process = mp.get_context("spawn").Process(target=_receiver_main, args=(child,), daemon=True)
        self.process.start()

    def request(self, method: str, **kwargs):
        self._conn.send((method, kwargs))
        status, result = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"{self.name}: {result}")
        return result

    async def _call(self, method: str, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(None, lambda: self.request(method, **kwargs))

    async def init_weights_update_group(self, master_address, master_port, rank_offset, world_size, group_name, backend):
        await self._call("join", master_address=master_address, master_port=master_port, rank=rank_offset,
                         world_size=world_size, group_name=group_name, backend=backend)

    async def destroy_weights_update_group(self, group_name):
        await self._call("leave")

    async def update_weights_from_distributed(self, names, dtypes, shapes, group_name, weight_version, load_format, checksum):
        await self._call("receive_bucket", names=names, dtypes=dtypes, shapes=shapes,
                         weight_version=weight_version, checksum=checksum, group_name=group_name)

    async def update_weights_from_disk(self, model_path, weight_version):
        await self._call("stage_from_disk", model_path=model_path, weight_version=weight_version)

    async def update_weight_version(self, new_version):
        await self._call("commit", weight_version=new_version)

    async def pause_generation(self, mode):  # receivers without a model do not generate
        pass

    async def continue_generation(self):
        await self._call("abort")

    async def flush_cache(self):
        pass


def random_state(model_fields: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**model_fields))
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(p.shape, generator=gen, dtype=torch.float32).to(dtype)
            for name, p in model.state_dict().items()}


def run(args) -> int:
    cfg = yaml.safe_load(Path(args.config).read_text()) or {}
    unknown = set(cfg) - {"model", "dtype", "bucket_mb", "num_engines", "output"}
    if unknown:
        raise ValueError(f"{args.config}: unknown fields {sorted(unknown)}")
    num_engines = int(cfg.get("num_engines", 2))
    if num_engines < 1:
        raise ValueError(f"num_engines: must be >= 1, got {num_engines}")
    bucket_bytes = int(cfg.get("bucket_mb", 256)) << 20
    state = random_state(cfg.get("model", {}), getattr(torch, cfg.get("dtype", "bfloat16")))
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    largest = max(t.numel() * t.element_size() for t in state.values())
    engines = [PipeEngine(f"bench-engine-{i}") for i in range(num_engines)]
    sender = WeightSender(engines, SyncConfig(bucket_bytes=bucket_bytes, backend="gloo", timeout_s=600))
    try:
        full_s = raw_s = 0.0
        flat = torch.empty(nbytes, dtype=torch.uint8)
        for version in (1, 2):  # version 1 warms up (page faults, connections)
            full_s = sender.update(iter(state.items()), version).seconds
            raw_s = raw_broadcast(sender, engines, flat)
        extra = sender.transport.packer.buffer_bytes + (largest if largest > bucket_bytes else 0)
    finally:
        sender.close()
        for engine in engines:
            engine.request("stop")
    result = dict(
        bytes=nbytes, tensors=len(state), num_engines=num_engines, bucket_bytes=bucket_bytes,
        full_seconds=full_s, full_gb_per_s=nbytes / full_s / 1e9,
        raw_seconds=raw_s, raw_gb_per_s=nbytes / raw_s / 1e9, ratio_raw_over_full=raw_s / full_s,
        peak_extra_bytes_source=extra, largest_tensor_bytes=largest,
        stream="random HF state dict in memory (not the Megatron export)",
    )
    for key, value in result.items():
        print(f"{key:>26}: {value:.4g}" if isinstance(value, float) else f"{key:>26}: {value}")
    output = Path(cfg.get("output", "bench_sync.json"))
    output.write_text(json.dumps(result, indent=2))
    print(f"wrote {output}")
    return 0


def raw_broadcast(sender: WeightSender, engines: list[PipeEngine], flat: torch.Tensor) -> float:
    """One broadcast of `flat` over the sender's group; the engines receive it in parallel."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(engines)) as pool:
        start = time.perf_counter()
        receives = [pool.submit(e.request, "raw_receive", nbytes=flat.numel()) for e in engines]
        sender.transport.group.broadcast(flat)
        for receive in receives:
            receive.result()
        return time.perf_counter() - start
