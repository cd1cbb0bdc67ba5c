"""Megatron trainer ranks (gloo, TP/EP layouts) -> streaming export -> sync -> receiver-only engines:
what every engine serves equals, bit for bit, what the export yielded on the source rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from parallel.layout import ParallelLayout
from parallel.world import spawn
from tests.sync.conftest import tiny_qwen3_moe_config
from tests.sync.test_sync_broadcast import assert_same

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

LAYOUTS = [ParallelLayout(world_size=4, tp=2, ep=2, sequence_parallel=True), ParallelLayout(world_size=4, ep=4)]


def export_and_sync(hf_dir: str, ports: list[int], out_dir: str, bucket_bytes: int) -> list[int]:
    """Rank function: per layout, import the HF weights (x2 for the second layout, so each
    version differs), export, and on rank 0 send the stream to the engines as version i+1."""
    import torch.distributed as dist

    from parallel.bridges import bridge_for
    from parallel.export import export_hf_weights, is_export_source
    from parallel.hf_import import load_hf_weights
    from parallel.model import build_gpt_model, init_model_parallel
    from sync.config import SyncConfig
    from sync.receiver_engine import ReceiverEngineClient
    from sync.sender import WeightSender, exhaust

    bridge = bridge_for(json.loads((Path(hf_dir) / "config.json").read_text()))
    sender = None
    if dist.get_rank() == 0:
        clients = [ReceiverEngineClient(port, name=f"engine-{i}") for i, port in enumerate(ports)]
        sender = WeightSender(clients, SyncConfig(bucket_bytes=bucket_bytes, timeout_s=60))
    written = []
    for version, layout in enumerate(LAYOUTS, start=1):
        init_model_parallel(layout, seed=1234)
        model = build_gpt_model(bridge, layout)
        load_hf_weights(model, bridge, hf_dir)
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(version)
        stream = export_hf_weights(model, bridge, bucket_bytes=bucket_bytes)
        if sender is not None:
            assert is_export_source()
            exported = {}

            def recorded(items):
                for name, tensor in items:
                    exported[name] = tensor.clone()
                    yield name, tensor

            sender.update(recorded(stream), version)
            save_file(exported, f"{out_dir}/exported-v{version}.safetensors")
            for i, client in enumerate(clients):  # what each engine serves now
                client.dump_weights(f"{out_dir}/engine{i}-v{version}.safetensors")
            written.append(version)
        else:
            exhaust(stream)
        dist.barrier()
    if sender is not None:
        sender.close()
    return written


@pytest.mark.parametrize("bucket_bytes", [4096, 1 << 20])
def test_megatron_export_to_engines_exact(engines, tmp_path, bucket_bytes):
    from transformers import Qwen3MoeForCausalLM

    clients, _ = engines
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(tiny_qwen3_moe_config()).save_pretrained(tmp_path / "hf")
    ports = [int(c.url.rsplit(":", 1)[1]) for c in clients]
    versions = spawn(export_and_sync, 4, str(tmp_path / "hf"), ports, str(tmp_path), bucket_bytes)[0]
    assert versions == [1, 2]
    exported = [load_file(tmp_path / f"exported-v{v}.safetensors") for v in versions]
    assert len(exported[0]) > 0 and not torch.equal(*[e["model.norm.weight"] for e in exported])
    for v, want in zip(versions, exported):
        for i in range(len(clients)):
            assert_same(load_file(tmp_path / f"engine{i}-v{v}.safetensors"), want)
    assert all(engine.served_version() == 2 for engine in clients)
