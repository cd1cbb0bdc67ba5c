"""The streaming export and FP8 block quantization on CUDA tensors: bit-equal to the checkpoint
and to the CPU quantization, nothing of a weight's size allocated in host memory on the way;
export GB/s and FP8 quantization GB/s. Under 1 GB of GPU memory, seconds."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from parallel.fp8 import BlockFP8
from parallel.world import spawn
from tests.engine.engine_helpers import save_tiny_model
from tests.gpu.metrics import record

pytestmark = pytest.mark.gpu


class HostAllocations(TorchDispatchMode):
    """Records the size of every CPU tensor an op creates."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self.largest = max(self.largest, t.numel())
        return out


def export_on_cuda(hf_dir: str) -> dict:
    """Rank function (one GPU): import the checkpoint, export it; every tensor stays on the GPU."""
    from parallel.bridges import bridge_for
    from parallel.export import export_hf_weights
    from parallel.hf_checkpoint import HFCheckpointReader
    from parallel.hf_import import load_hf_weights
    from parallel.layout import ParallelLayout
    from parallel.model import build_gpt_model, init_model_parallel

    layout = ParallelLayout(world_size=1)
    init_model_parallel(layout, seed=0)
    bridge = bridge_for(json.loads((Path(hf_dir) / "config.json").read_text()))
    model = build_gpt_model(bridge, layout)
    load_hf_weights(model, bridge, hf_dir)
    reader = HFCheckpointReader(hf_dir)
    dict(export_hf_weights(model, bridge))  # warm-up
    torch.cuda.synchronize()
    watch = HostAllocations()
    start = time.perf_counter()
    with watch:
        exported = dict(export_hf_weights(model, bridge))
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {
        "names_match": set(exported) == reader.names(),
        "on_gpu": all(t.is_cuda for t in exported.values()),
        "mismatched": [n for n, t in exported.items() if not torch.equal(t.cpu(), reader.read(n))],
        "largest_host_tensor": watch.largest,
        "bytes": sum(t.nbytes for t in exported.values()),
        "seconds": seconds,
    }


def test_export_on_cuda_is_exact_and_stays_on_the_gpu(tmp_path):
    hf_dir = save_tiny_model("qwen3_moe", tmp_path / "hf")
    result = spawn(export_on_cuda, 1, str(hf_dir))[0]
    assert result["names_match"] and result["on_gpu"] and result["mismatched"] == []
    assert result["largest_host_tensor"] < 1024, "the export made a host copy of a weight"
    record("export_gb_per_s", result["bytes"] / result["seconds"] / 1e9, "GB/s (tiny model, one GPU)")


def test_fp8_quantization_on_cuda_equals_the_cpu_and_makes_no_host_copy():
    block = BlockFP8(128, 128)
    weight = torch.randn(1536, 7168 // 4, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    weight[:, :128] = 0  # an all-zero block keeps factor 1
    expected_q, expected_scale = block.quantize(weight)
    on_gpu = weight.cuda()
    watch = HostAllocations()
    with watch:
        q, scale = block.quantize(on_gpu)
    assert q.is_cuda and scale.is_cuda and watch.largest == 0
    assert torch.equal(q.cpu().view(torch.uint8), expected_q.view(torch.uint8))
    assert torch.equal(scale.cpu(), expected_scale)
    big = torch.randn(8, 4096, 4096, device="cuda", dtype=torch.bfloat16)
    block.quantize(big)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        block.quantize(big)
    torch.cuda.synchronize()
    record("fp8_quantize_gb_per_s", 5 * big.nbytes / (time.perf_counter() - start) / 1e9, "GB/s of bf16 input")
