"""Adapter-only sync while the rollout manager generates, on a real embedded engine.

Versions 0..N are published as `policy-v{N}` (sync.lora.AdapterSync) between batches of the
long-tailed task, the way the RL job does. Proves: every sample's tokens carry one adapter version
(requests in flight finish on the adapter they started with; nothing is paused), requests only
name adapters loaded at that moment, at most max_staleness + 1 adapters stay loaded, the disk
route never deletes a directory an engine may still load or use, and every group is accounted for.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from safetensors import safe_open

from moe_rl.engine.client import EngineClient
from moe_rl.engine.pool import EnginePool
from moe_rl.engine.process import EmbeddedConfig, launch_embedded
from moe_rl.rollout import RolloutConfig, RolloutManager
from parallel.peft import write_adapter
from sync.config import AdapterSyncConfig
from sync.lora import AdapterSync, adapter_name

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

STALENESS, VERSIONS = 1, 5
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def random_adapter(model_dir, seed: int, rank: int = 2) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config, tensors): a random adapter on every projection, experts one each."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    with safe_open(f"{model_dir}/model.safetensors", "pt") as f:
        for name in f.keys():
            if name.endswith(".weight") and name.split(".")[-2] in TARGETS:
                out_features, in_features = f.get_slice(name).get_shape()
                module = f"base_model.model.{name[: -len('.weight')]}"
                tensors[f"{module}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator)
                tensors[f"{module}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator)
    config = dict(
        peft_type="LORA",
        task_type="CAUSAL_LM",
        r=rank,
        lora_alpha=2 * rank,
        target_modules=list(TARGETS),
        lora_dropout=0.0,
        bias="none",
    )
    return config, tensors


class RecordingPool(EnginePool):
    """Checks, as each request leaves, that its adapter is loaded on the engine."""

    def __init__(self, clients, sync: AdapterSync):
        super().__init__(clients)
        self.sync, self.named = sync, []

    async def generate(self, input_ids, sampling, *, group_id=None, **kwargs):
        self.named.append((kwargs["lora_path"], [adapter_name(v) for v in self.sync.loaded]))
        return await super().generate(input_ids, sampling, group_id=group_id, **kwargs)


@pytest.mark.parametrize("route", ["tensors", "disk"])
def test_adapter_versions_while_generating(model_dirs, tmp_path, route):
    directory = tmp_path / "adapters"
    config = RolloutConfig(
        task="copy_digits_long_tail",
        task_options={"num_stop_tokens": 12},
        groups_per_step=2,
        n_samples_per_prompt=2,
        max_new_tokens=24,
        max_staleness=STALENESS,
        return_routed_experts=True,
    )
    with launch_embedded(EmbeddedConfig(model_path=model_dirs[0], weight_version="0", threads=1)) as engine:
        client = EngineClient(engine.url, name="engine-0")
        sync = AdapterSync(
            [client], AdapterSyncConfig(route=route, directory=str(directory), keep=STALENESS + 1), write_adapter
        )
        try:
            batches, on_disk = asyncio.run(_run(config, client, sync, model_dirs[0], directory))
            served = asyncio.run(EngineClient(engine.url).model_info())
        finally:
            sync.close()
    samples = [s for batch in batches for group in batch for s in group]
    assert len(batches) == VERSIONS
    for sample in samples:
        assert sample.response_ids and len(set(sample.weight_versions)) == 1, sample.weight_versions
        assert sample.segments == 1  # never cut: generation did not pause
        assert sample.routed_experts is not None
    trained_at = [v for v, batch in enumerate(batches) for group in batch for s in group]
    for version, sample in zip(trained_at, samples):
        assert version - STALENESS <= sample.weight_versions[0] <= version
    for loaded_now in on_disk:  # disk: every loaded version's directory exists
        assert all(present for present in loaded_now.values())
    assert len(sync.loaded) == STALENESS + 1
    assert set(served["lora_adapters"]) <= {adapter_name(v) for v in range(VERSIONS - STALENESS - 2, VERSIONS + 1)}
    assert {adapter_name(v) for v in sync.loaded} <= set(served["lora_adapters"])
    if route == "disk":
        left = {p.name for p in directory.iterdir()}
        assert {adapter_name(v) for v in sync.loaded} <= left
        assert len(left) <= STALENESS + 2 and not any(name.startswith(".tmp") for name in left)


async def _run(config, client, sync, model_dir, directory):
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sync.publish, 0, *random_adapter(model_dir, 0))
    pool = RecordingPool([client], sync)
    manager = RolloutManager(config, pool, adapters=True)
    task = asyncio.create_task(manager.run())
    batches, on_disk = [], []
    try:
        for version in range(VERSIONS):
            batches.append(await manager.buffer.get_batch(config.groups_per_step))
            # the job's step: publish the next version without pausing, then tell the buffer
            await loop.run_in_executor(None, sync.publish, version + 1, *random_adapter(model_dir, version + 1))
            on_disk.append(
                {v: (directory / adapter_name(v)).is_dir() for v in sync.loaded} if sync.config.route == "disk" else {}
            )
            await manager.buffer.set_version(version + 1)
            if version + 1 < VERSIONS:  # a trainer's step takes time: the new adapter gets requests before the next
                await _requested(pool, adapter_name(version + 1))
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    for named, loaded in pool.named:
        assert named in loaded, (named, loaded)
    # each published adapter served requests (which of them a batch holds is the machine's timing)
    assert {adapter_name(v) for v in range(VERSIONS)} <= {named for named, _ in pool.named}
    accounting = manager.accounting()
    assert (
        accounting["started"]
        == (accounting["delivered"] + accounting["dropped"] + accounting["queued"] + accounting["open"])
        > 0
    )
    return batches, on_disk


async def _requested(pool: RecordingPool, name: str, timeout_s: float = 60.0) -> None:
    """Wait until a request has named adapter `name` (the round its version admits has started)."""

    async def named() -> None:
        while not any(lora_path == name for lora_path, _ in pool.named):
            await asyncio.sleep(0.01)

    await asyncio.wait_for(named(), timeout_s)
