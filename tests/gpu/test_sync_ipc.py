"""A weight sync from this (trainer) process into an embedded engine process on the same GPU over
CUDA-IPC handles (`cuda_ipc` transport, SGLang's `/update_weights_from_tensor` route), without
SGLang: the engine then serves exactly what an engine loaded from the same weights serves; the
sender's peak extra GPU memory stays within its bucket bound; the sync's GB/s through IPC.
With two GPUs: the `broadcast` transport over NCCL into an engine on the second GPU."""

from __future__ import annotations

import time

import pytest
import torch

from moe_rl.engine.client import EngineClient
from moe_rl.engine.embedded.runner import load_checkpoint_state
from moe_rl.engine.process import EmbeddedConfig, launch_embedded
from moe_rl.engine.sampling import SamplingParams
from sync.config import SyncConfig
from sync.sender import WeightSender
from tests.engine.engine_helpers import run, save_tiny_model, with_client
from tests.gpu.metrics import record

pytestmark = pytest.mark.gpu

PROMPTS = [[(7 * i + j) % 256 for j in range(5 + i)] for i in range(4)]


async def generate(client):
    """One request at a time: a GPU's sums depend on the batch a request shares, and on a random
    tiny MoE a last-bit difference can flip a near-tied router (seen on an H200 with concurrent
    requests: one logprob 0.13 apart); alone, each request runs the same kernels on both engines."""
    out = []
    for i, p in enumerate(PROMPTS):
        result = await client.generate(p, SamplingParams(max_new_tokens=12, sampling_seed=i, ignore_eos=True))
        out.append((result.output_ids, result.logprobs))
    return out


def served_by_fresh_engine(model_dir, device: str):
    with launch_embedded(EmbeddedConfig(model_path=model_dir, device=device), timeout_s=300) as engine:
        return run(with_client(engine.url, generate))


def sync_into_engine(old_dir, new_dir, transport: str, engine_device: str) -> tuple[list, dict]:
    state = {n: t.to("cuda:0") for n, t in sorted(load_checkpoint_state(new_dir).items())}
    bucket_bytes = 64 << 10
    largest = max(t.nbytes for t in state.values())
    with launch_embedded(EmbeddedConfig(model_path=old_dir, device=engine_device), timeout_s=300) as engine:
        client = EngineClient(engine.url)
        sender = WeightSender([client], SyncConfig(transport=transport, bucket_bytes=bucket_bytes, timeout_s=120))
        try:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            stats = sender.update(iter(state.items()), version=1)
            seconds = time.perf_counter() - start
            extra = torch.cuda.max_memory_allocated() - base
            served = run(generate(client))
        finally:
            sender.close()
            run(client.close())
    assert stats.bytes == sum(t.nbytes for t in state.values())
    print(f"{transport}: peak extra GPU memory {extra} B, bound {2 * bucket_bytes + largest} B")
    assert extra <= 2 * bucket_bytes + largest
    return served, {"bytes": stats.bytes, "seconds": seconds}


def test_cuda_ipc_sync_into_an_engine_on_the_same_gpu(tmp_path):
    old_dir = save_tiny_model("qwen3_moe", tmp_path / "old", seed=0)
    new_dir = save_tiny_model("qwen3_moe", tmp_path / "new", seed=1)
    served, timing = sync_into_engine(old_dir, new_dir, "cuda_ipc", "cuda:0")
    assert served == served_by_fresh_engine(new_dir, "cuda:0")  # token ids and logprobs, exactly
    record("sync_ipc_gb_per_s", timing["bytes"] / timing["seconds"] / 1e9, "GB/s (tiny model, 64 KiB buckets)")


def test_nccl_broadcast_sync_into_an_engine_on_another_gpu(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    old_dir = save_tiny_model("qwen3_moe", tmp_path / "old", seed=0)
    new_dir = save_tiny_model("qwen3_moe", tmp_path / "new", seed=1)
    served, timing = sync_into_engine(old_dir, new_dir, "broadcast", "cuda:1")
    assert served == served_by_fresh_engine(new_dir, "cuda:1")
    record("sync_nccl_gb_per_s", timing["bytes"] / timing["seconds"] / 1e9, "GB/s (tiny model, 64 KiB buckets)")


def broadcast_bandwidth(nbytes: int, repeats: int) -> float:
    """Rank function (NCCL, 2 GPUs): GB/s of a broadcast of `nbytes` from rank 0, after a warm-up."""
    import torch.distributed as dist

    buffer = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dist.broadcast(buffer, src=0)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        dist.broadcast(buffer, src=0)
    torch.cuda.synchronize()
    return repeats * nbytes / (time.perf_counter() - start) / 1e9


def test_nccl_broadcast_bandwidth_gives_plan_its_nvlink_efficiency():
    """A raw 1 GiB NCCL broadcast between two GPUs of this node: `moe-rl plan`'s measured NVLink
    efficiency (GB/s x 8 over `cluster.nvlink_gbps`). 2 GiB of GPU memory, seconds."""
    from moe_rl.config import ClusterConfig
    from parallel.world import spawn

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    gb_per_s = spawn(broadcast_bandwidth, 2, 1 << 30, 10)[0]
    record("nccl_broadcast_gb_per_s", gb_per_s, "GB/s (1 GiB broadcast, 2 GPUs of one node)")
    record("nvlink_efficiency", gb_per_s * 8 / ClusterConfig().nvlink_gbps, "of cluster.nvlink_gbps")
