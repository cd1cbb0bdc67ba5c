"""`moe-rl bench sync CONFIG` with a `lora:` section (options: `moe_rl.bench.options.SyncBench`):
adapter vs full-weight sync, same model, one run.

Trainer: a Megatron GPTModel (random init) with LoRA adapters of `lora.rank` on every target
(random B, so the adapter is not zero), on `layout.world_size` gloo ranks. Engine: one real
embedded engine serving the frozen base. While a client keeps long requests running on the
engine (the long tail), each repeat times, in order:
  - adapter, tensors route: collect the adapters (TP/EP gathers) + AdapterSync.publish
    (`/load_lora_adapter_from_tensors`, checksummed), the new version's requests name it;
  - adapter, disk route: the same through a PEFT directory and `/load_lora_adapter`;
  - full: the merged weights exported and broadcast by the WeightSender (pause abort, flush,
    buckets, commit, continue), the path of engines without LoRA.
Reports bytes and seconds of each (best of the repeats), the ratios, and the requests the
engine cut (finish reason "abort") during each phase: the adapter phases pause nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from moe_rl.bench.options import SyncBench
from moe_rl.engine.client import EngineClient
from moe_rl.engine.process import EmbeddedConfig, launch_embedded
from moe_rl.engine.sampling import SamplingParams
from parallel.bridges import bridge_for
from parallel.export import export_hf_weights, save_hf_checkpoint
from parallel.lora import LoRAConfig, add_lora
from parallel.model import build_gpt_model, init_model_parallel
from parallel.peft import collect_adapter, write_adapter
from parallel.world import spawn
from sync.config import AdapterSyncConfig, SyncConfig
from sync.lora import AdapterSync, adapter_name
from sync.sender import WeightSender, exhaust


class LongTail:
    """A client thread keeping `concurrency` long requests on the engine, each naming the
    adapter `adapter()` returns at its start; counts the finish reasons by the phase each
    request ended in."""

    def __init__(self, url: str, adapter, concurrency: int = 4, max_new_tokens: int = 8):
        self.url, self.adapter, self.concurrency, self.max_new_tokens = url, adapter, concurrency, max_new_tokens
        self.phase, self.finished = "warmup", {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self._thread.start()

    async def _main(self) -> None:

        client = EngineClient(self.url, name="long-tail")
        await asyncio.gather(*(self._worker(client, i) for i in range(self.concurrency)))

    async def _worker(self, client, index: int) -> None:
        while not self._stop.is_set():
            lora = self.adapter()
            result = await client.generate(
                [1, 10 + index, 2],
                SamplingParams(max_new_tokens=self.max_new_tokens, ignore_eos=True, sampling_seed=index),
                **{"lora_path": lora} if lora else {},
            )
            counts = self.finished.setdefault(self.phase, {})  # the phase it ended in: a pause cuts it there
            counts[result.finish_reason] = counts.get(result.finish_reason, 0) + 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)


def rank_main(options: SyncBench, work_dir: str) -> dict | None:
    """Rank function: every rank runs the collectives; rank 0 owns the engine and both syncs."""
    # heavy: transformers, only where an HF config, model or tokenizer is read
    from transformers import Qwen3MoeConfig

    layout, hf_config = options.layout, Qwen3MoeConfig(**options.model)
    bridge, lora = bridge_for(hf_config), LoRAConfig(**options.lora)
    init_model_parallel(layout, seed=0)
    model = build_gpt_model(bridge, layout, use_te=False)
    for adapter in add_lora(model, bridge, lora, seed=0).values():
        torch.nn.init.normal_(adapter.lora_B, std=0.01)
    save_hf_checkpoint(model, bridge, f"{work_dir}/base", hf_config.to_dict(), merge_adapters=False)
    repeats = options.repeats
    if dist.get_rank() != 0:
        for _ in range(2 * repeats):  # rank 0's order: every adapter sync, then every full one
            collect_adapter(model, bridge, lora)
        for _ in range(repeats):
            exhaust(export_hf_weights(model, bridge))
        return None

    times: dict[str, list[float]] = {"adapter_tensors": [], "adapter_disk": [], "full": []}
    sizes = {}
    with launch_embedded(EmbeddedConfig(model_path=f"{work_dir}/base", weight_version="0", threads=1)) as engine:
        routes = {
            route: AdapterSync(
                [EngineClient(engine.url, name="engine-0")],
                AdapterSyncConfig(route=route, directory=f"{work_dir}/adapters", keep=2),
                write_adapter,
            )
            for route in ("tensors", "disk")
        }
        newest = [None]
        tail = LongTail(engine.url, lambda: newest[0])
        sender = WeightSender(
            [EngineClient(engine.url, name="engine-0")],
            SyncConfig(bucket_bytes=64 << 20, backend="gloo", pause_mode="abort"),
        )
        try:
            for repeat in range(repeats):
                for route, version in (("tensors", 2 * repeat), ("disk", 2 * repeat + 1)):
                    tail.phase = f"adapter_{route}"
                    start = time.perf_counter()
                    stats = routes[route].publish(version, *collect_adapter(model, bridge, lora))
                    times[f"adapter_{route}"].append(time.perf_counter() - start)
                    sizes["adapter"] = stats.bytes
                    newest[0] = adapter_name(version)
            newest[0] = None  # full sync: the engine serves merged weights, requests use no adapter
            for repeat in range(repeats):
                tail.phase = "full"
                start = time.perf_counter()
                stats = sender.update(export_hf_weights(model, bridge), repeat + 1)
                times["full"].append(time.perf_counter() - start)
                sizes["full"] = stats.bytes
        finally:
            tail.stop()
            sender.close()
            for sync in routes.values():
                sync.close()
    best = {key: min(values) for key, values in times.items()}
    return dict(
        layout=dataclasses.asdict(layout),
        lora=options.lora,
        adapter_bytes=sizes["adapter"],
        full_bytes=sizes["full"],
        bytes_ratio_full_over_adapter=sizes["full"] / sizes["adapter"],
        seconds=times,
        best_s=best,
        seconds_ratio_full_over_adapter=best["full"] / best["adapter_tensors"],
        requests_finished=tail.finished,
        aborted_during_adapter_syncs=sum(
            tail.finished.get(p, {}).get("abort", 0) for p in ("adapter_tensors", "adapter_disk")
        ),
        aborted_during_full_syncs=tail.finished.get("full", {}).get("abort", 0),
    )


def run(options: SyncBench) -> dict:
    """Rank 0's figures, written to `options.output_path`."""
    with tempfile.TemporaryDirectory() as work_dir:
        result = spawn(rank_main, options.layout.world_size, options, work_dir, timeout_s=3600)[0]
    Path(options.output_path).write_text(json.dumps(result, indent=2))
    return result


def show(result: dict, output: str) -> None:
    for key, value in result.items():
        print(f"{key:>34}: {value}")
    print(f"wrote {output}")
