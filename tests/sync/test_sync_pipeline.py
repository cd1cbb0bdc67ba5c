"""Pipeline parallel trainer worlds -> `sync.pipeline.stage_stream` funnel -> one weight-update
group -> receiver-only engines: every engine serves exactly the HF checkpoint (all layers, every stage)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from parallel.layout import ParallelLayout
from parallel.world import spawn
from tests.sync.conftest import tiny_qwen3_moe_config
from tests.sync.test_sync_broadcast import assert_same

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)


def pp_export_and_sync(hf_dir: str, ports: list[int], out_dir: str, layout: ParallelLayout) -> int | None:
    """Rank function: import the HF weights into `layout`, scale by the version, funnel every
    stage's export to the sync source and send it as versions 1 and 2."""
    import torch.distributed as dist

    from parallel.bridges import bridge_for
    from parallel.export import export_hf_weights, export_source_ranks
    from parallel.hf_import import load_hf_weights
    from parallel.model import build_gpt_model, init_model_parallel
    from sync.config import SyncConfig
    from sync.pipeline import stage_stream, sync_source
    from sync.receiver_engine import ReceiverEngineClient
    from sync.sender import WeightSender, exhaust

    bridge = bridge_for(json.loads((Path(hf_dir) / "config.json").read_text()))
    init_model_parallel(layout, seed=1234)
    model = build_gpt_model(bridge, layout)
    load_hf_weights(model, bridge, hf_dir)
    sources = export_source_ranks()
    assert len(sources) == layout.pp
    is_sync_source = dist.get_rank() == sync_source(sources)
    clients = [ReceiverEngineClient(port, name=f"engine-{i}") for i, port in enumerate(ports)]
    sender = WeightSender(clients, SyncConfig(bucket_bytes=16384, timeout_s=60)) if is_sync_source else None
    for version in (1, 2):
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(version / (version - 1) if version > 1 else 1)
        stream = stage_stream(export_hf_weights(model, bridge, bucket_bytes=16384), sources)
        if sender is not None:
            sender.update(stream, version)
            for i, client in enumerate(clients):
                client.dump_weights(f"{out_dir}/engine{i}-v{version}.safetensors")
        else:
            exhaust(stream)
        dist.barrier()
    if sender is not None:
        sender.close()
        return sender.version
    return None


@pytest.mark.parametrize(
    "layout",
    [
        ParallelLayout(world_size=2, pp=2),
        ParallelLayout(world_size=4, pp=2, ep=2),
    ],
    ids=["pp2", "pp2-ep2"],
)
def test_pipeline_stages_reach_engines_exact(engines, tmp_path, layout):
    from transformers import Qwen3MoeForCausalLM

    clients, _ = engines
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(tiny_qwen3_moe_config()).save_pretrained(tmp_path / "hf")
    ports = [int(c.url.rsplit(":", 1)[1]) for c in clients]
    results = spawn(pp_export_and_sync, layout.world_size, str(tmp_path / "hf"), ports, str(tmp_path), layout)
    assert results[0] == 2 and results[1:] == [None] * (layout.world_size - 1)
    checkpoint = load_file(tmp_path / "hf" / "model.safetensors")
    assert {
        "model.layers.0.mlp.experts.3.down_proj.weight",
        "model.layers.1.mlp.gate.weight",
        "model.embed_tokens.weight",
        "lm_head.weight",
    } <= set(checkpoint)  # both stages' layers
    for version in (1, 2):
        want = {name: tensor * version for name, tensor in checkpoint.items()}
        for i in range(len(clients)):
            assert_same(load_file(tmp_path / f"engine{i}-v{version}.safetensors"), want)
    assert all(engine.served_version() == 2 for engine in clients)
