"""Colocated RL (`rl.colocate`): engines and trainer take turns on the same devices.

One step of the RL job, colocated (only `rl.mode: sync`, checked by the config):
  1. the engines generate the step's batch (the rollout worker; staleness 0);
  2. `engines_released`: every engine pauses (abort: in sync mode only cancelled oversampled
     requests can still be running) and releases its weights and KV cache
     (`/release_memory_occupation`, tags weights + kv_cache);
  3. the trainer trains on the freed memory (it offloads nothing itself);
  4. the engines re-allocate (`/resume_memory_occupation`): their weights hold nothing valid;
  5. the job's weight update re-syncs every weight as the new version (broadcast or disk on CPU,
     cuda_ipc on GPUs) and the sender's `/continue_generation` lets generation start again.
The engines report their state in `/model_info` (`weights_state`, `weight_bytes`); the step logs
what they reported while the trainer trained (`colocate/engine_weight_bytes`) and before
(`colocate/engine_weight_bytes_before`), summed over engines, plus the release/resume seconds.

On GPUs the engines must sit on the trainer's GPUs (SGLang launched with --enable-memory-saver);
on CPU the embedded engine frees its tensors the same way, which is what the tests check.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import contextmanager

import ray

from moe_rl.engine.client import EngineClient, engine_name

TAGS = ["weights", "kv_cache"]


def _on_engines(urls: list[str], kind: str, call) -> list:
    """`await call(client)` on every engine at once, from the driver; their results in order."""

    async def run():
        clients = [EngineClient(url, kind=kind, name=engine_name(i)) for i, url in enumerate(urls)]
        try:
            return await asyncio.gather(*(call(client) for client in clients))
        finally:
            await asyncio.gather(*(client.close() for client in clients))

    return asyncio.run(run())


def _weight_bytes(urls: list[str], kind: str) -> float:
    infos = _on_engines(urls, kind, lambda client: client.model_info())
    return float(sum(info.get("weight_bytes", 0) for info in infos))


@contextmanager
def engines_released(engines: list, kind: str, colocate: bool, metrics: dict):
    """Around the train step: steps 2 and 4 of the module docstring when `colocate`, else nothing.
    `engines`: the `EngineServer` actors. The weight update that must follow is the caller's."""
    if not colocate:
        yield
        return
    urls = ray.get([engine.url.remote() for engine in engines])
    metrics["colocate/engine_weight_bytes_before"] = _weight_bytes(urls, kind)
    start = time.perf_counter()

    async def release(client: EngineClient) -> None:
        await client.pause_generation("abort")
        await client.release_memory_occupation(TAGS)

    _on_engines(urls, kind, release)
    metrics["time/release_s"] = time.perf_counter() - start
    metrics["colocate/engine_weight_bytes"] = _weight_bytes(urls, kind)
    yield
    start = time.perf_counter()
    _on_engines(urls, kind, lambda client: client.resume_memory_occupation(TAGS))
    metrics["time/resume_s"] = time.perf_counter() - start
