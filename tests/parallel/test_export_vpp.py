"""Virtual pipeline parallelism: import into and export from a list of model chunks.

PP2 x VPP2 over a 4-layer Qwen3-MoE on 2 ranks: each rank holds two one-layer chunks (rank 0
layers 0 and 2, rank 1 layers 1 and 3). Import -> export is bit-exact, every HF tensor comes
out exactly once, each rank exports exactly its chunks' global layers, and the interleaved
schedule's logits equal transformers'.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from test_bridge_harness import BATCH, SEQ, hf_reference, save_tiny_hf_model
from test_bridge_qwen3_moe import qwen3_moe_config

from parallel.world import spawn

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

VPP = 2


def vpp_roundtrip(hf_dir: str, tokens: torch.Tensor) -> dict:
    """Rank function: build the chunks, import, export (compared with the file), forward."""
    import torch.distributed as dist

    from parallel import cpu_compat

    cpu_compat.apply()
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from parallel.bridges import bridge_for
    from parallel.export import export_hf_weights
    from parallel.hf_checkpoint import HFCheckpointReader
    from parallel.hf_import import load_hf_weights
    from parallel.layout import ParallelLayout

    layout = ParallelLayout(world_size=2, pp=2)
    ps.initialize_model_parallel(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=VPP)
    torch.manual_seed(dist.get_rank())
    model_parallel_cuda_manual_seed(dist.get_rank())
    bridge = bridge_for(json.loads((Path(hf_dir) / "config.json").read_text()))
    config = bridge.transformer_config(layout, virtual_pipeline_model_parallel_size=VPP)
    chunks = [
        GPTModel(
            config=config,
            transformer_layer_spec=bridge.layer_spec(config, use_te=False, vp_stage=i),
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=i),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=i),
            vp_stage=i,
            **bridge.gpt_model_kwargs(layout),
        )
        for i in range(VPP)
    ]
    load_hf_weights(chunks, bridge, hf_dir)
    reader = HFCheckpointReader(hf_dir)
    names, mismatched = [], []
    for name, tensor in export_hf_weights(chunks, bridge, bucket_bytes=4096):
        names.append(name)
        if not torch.equal(tensor, reader.read(name)):
            mismatched.append(name)

    b, s = tokens.shape
    batches = [(tokens[i : i + 1], torch.arange(s).expand(1, s)) for i in range(b)]

    def step(iterator, chunk):
        ids, positions = next(iterator)
        return chunk(ids, positions, None), lambda out, non_loss_data=True: out

    for chunk in chunks:
        chunk.eval()
    with torch.no_grad():
        outputs = get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=[iter(batches) for _ in chunks],
            model=chunks,
            num_microbatches=b,
            seq_length=s,
            micro_batch_size=1,
            forward_only=True,
            collect_non_loss_data=True,
        )
    last = ps.is_pipeline_last_stage(ignore_virtual=True)
    logits = torch.cat(outputs)[..., : bridge.vocab_size].numpy().copy() if last else None
    ps.destroy_model_parallel()
    return dict(pp_rank=dist.get_rank(), names=names, mismatched=mismatched, logits=logits)


def test_pp2_vpp2_import_export_and_logits(tmp_path):
    hf_dir = save_tiny_hf_model(qwen3_moe_config(num_hidden_layers=4), tmp_path / "hf")
    tokens = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    results = spawn(vpp_roundtrip, 2, str(hf_dir), tokens)

    from parallel.hf_checkpoint import HFCheckpointReader

    exported = [n for r in results for n in r["names"]]
    assert not [n for r in results for n in r["mismatched"]]
    assert sorted(exported) == sorted(HFCheckpointReader(hf_dir).names())
    for rank, result in enumerate(results):
        layers = {int(m.group(1)) for n in result["names"] if (m := re.match(r"model\.layers\.(\d+)\.", n))}
        assert layers == {rank, rank + 2}, (rank, layers)  # chunk c of stage r holds layer c * pp + r
    reference = hf_reference(hf_dir, tokens)
    diff = (torch.from_numpy(results[1]["logits"]) - reference).abs().max().item()
    assert diff <= 1e-4, f"max |megatron - transformers| logits = {diff}"
