"""Export memory bound, measured: on an EP2 world with 128 experts per layer, the resident
memory of the exporting rank grows by at most ~one bucket while it streams every tensor;
with a bucket as large as the model the same measurement sees the whole model gathered."""

from __future__ import annotations

import gc

import pytest
from test_bridge_qwen3_moe import qwen3_moe_config

from parallel.layout import ParallelLayout
from parallel.world import spawn

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

MiB = 2**20


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def export_peak(config: dict, layout: ParallelLayout, bucket_bytes_list: list[int]) -> list[tuple[int, int, int]]:
    """Rank function: per bucket size, (peak RSS growth during export, items, bytes exported)."""
    from parallel.bridges import bridge_for
    from parallel.export import export_hf_weights
    from parallel.model import build_gpt_model, init_model_parallel

    bridge = bridge_for(config)
    init_model_parallel(layout, seed=0)
    model = build_gpt_model(bridge, layout)
    results = []
    for bucket_bytes in bucket_bytes_list:
        gc.collect()
        baseline = peak = _rss_bytes()
        items = total = 0
        for _name, tensor in export_hf_weights(model, bridge, bucket_bytes=bucket_bytes):
            peak = max(peak, _rss_bytes())
            items, total = items + 1, total + tensor.numel() * tensor.element_size()
            del tensor  # the consumer drops each item, as a bucket sender does after copying it
        results.append((peak - baseline, items, total))
    return results


def test_export_stays_within_one_bucket(monkeypatch):
    # Fixed mmap threshold in the ranks (fresh processes: glibc reads it at start): every tensor
    # > 16 KiB is its own mapping, returned to the OS when freed, so RSS counts the tensors alive.
    # The first pass warms up one-time costs (lazy imports, gloo buffers) and is not judged.
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(16 * 1024))
    config = qwen3_moe_config(
        hidden_size=128, moe_intermediate_size=128, num_experts=128, num_hidden_layers=2, mlp_only_layers=[]
    ).to_dict()
    layout = ParallelLayout(world_size=2, ep=2)
    bucket = 2 * MiB
    (_warmup, small, huge), _ = spawn(export_peak, 2, config, layout, [bucket, bucket, 1024 * MiB], fresh=True)
    growth, items, total = small
    assert items == 2 * (128 * 3 + 9) + 3 and total > 45 * MiB  # every HF tensor, ~50 MiB
    assert growth <= bucket + 2 * MiB, f"export grew RSS by {growth / MiB:.1f} MiB with a {bucket / MiB} MiB bucket"
    assert huge[0] >= total / 2, "the measurement must see a model-sized bucket"
    print(
        f"peak RSS growth: {growth / MiB:.2f} MiB (bucket 2 MiB) vs {huge[0] / MiB:.1f} MiB "
        f"(bucket 1 GiB), {total / MiB:.1f} MiB exported"
    )
