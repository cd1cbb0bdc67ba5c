"""FP8 rollout weights are quantized where the weight lives, and EP gathers are collectives.

- On TP2 x EP2 and PP2 x EP2 gloo worlds, `export_hf_weights(..., fp8=...)` yields exactly the
  bytes and scales of `BlockFP8.quantize_stream` applied to the full-precision export (the
  reference the SGLang dequantization tests already hold), for block sizes that divide the TP
  shards (each shard quantizes alone, before its gather) and sizes that do not (quantized right
  after the gather that aligns it), while the gathers carry FP8 bytes (fewer bytes sent).
- On the meta device (no memory, no host), the export's FP8 path allocates every output on the
  weight's own device: nothing is copied to the host on the way.
"""

from __future__ import annotations

import pytest
import torch

from parallel.fp8 import BlockFP8
from parallel.layout import ParallelLayout
from parallel.mappings import Axis, ColumnParallel, GatedColumn, ParallelContext, RowParallel
from parallel.world import spawn
from tests.tiny_models import QWEN3_MOE, hf_config

LAYOUTS = [ParallelLayout(world_size=4, tp=2, ep=2, sequence_parallel=True), ParallelLayout(world_size=4, pp=2, ep=2)]
BLOCKS = [BlockFP8(16, 16), BlockFP8(24, 24)]  # 16 divides every TP shard of the tiny model, 24 none


def _export_both(config: dict, layouts: list[ParallelLayout], blocks: list[BlockFP8]) -> list:
    """Rank function: per layout and block size, (mismatched names, tensors, gather bytes sent with
    and without FP8) on the stage sources; gather bytes only elsewhere."""
    from megatron.core import parallel_state

    from parallel.bridges import bridge_for
    from parallel.export import export_hf_weights, is_export_source
    from parallel.gathers import GATHER_BYTES
    from parallel.model import build_gpt_model, init_model_parallel

    bridge = bridge_for(config)
    results = []
    for layout in layouts:
        init_model_parallel(layout, seed=0)
        model = build_gpt_model(bridge, layout)
        for fp8 in blocks:
            before = GATHER_BYTES["sent"]
            plain = list(export_hf_weights(model, bridge, bucket_bytes=1 << 20))
            plain_sent, before = GATHER_BYTES["sent"] - before, GATHER_BYTES["sent"]
            quantized = list(export_hf_weights(model, bridge, bucket_bytes=1 << 20, fp8=fp8))
            fp8_sent = GATHER_BYTES["sent"] - before
            expected = list(fp8.quantize_stream(plain))
            wrong = [
                name
                for (name, got), (want_name, want) in zip(quantized, expected)
                if name != want_name or got.dtype != want.dtype or not torch.equal(_bytes(got), _bytes(want))
            ]
            if len(quantized) != len(expected):
                wrong.append(f"{len(quantized)} tensors, expected {len(expected)}")
            results.append((is_export_source(), wrong, len(quantized), plain_sent, fp8_sent))
        parallel_state.destroy_model_parallel()
    return results


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(-1).view(torch.uint8)


@pytest.mark.world
def test_fp8_export_equals_quantizing_the_full_export_and_gathers_fp8():
    config = hf_config(QWEN3_MOE, num_hidden_layers=2).to_dict()
    per_rank = spawn(_export_both, 4, config, LAYOUTS, BLOCKS)
    for rank, results in enumerate(per_rank):
        for (source, wrong, count, plain_sent, fp8_sent), case in zip(
            results, [(lo, b) for lo in LAYOUTS for b in BLOCKS]
        ):
            assert not wrong, (rank, case, wrong[:5])
            if source:
                assert count > 0, (rank, case)
            # what a rank sends into its source is never more with FP8, and with whole-block shards
            # (16) or an EP gather (which always follows the quantization) strictly less
            assert fp8_sent <= plain_sent, (rank, case, plain_sent, fp8_sent)
            if plain_sent and case[1] == BLOCKS[0]:
                assert fp8_sent < plain_sent, (rank, case, plain_sent, fp8_sent)


def test_fp8_export_stays_on_the_weights_device():
    """Every mapping kind that can hold a decoder linear, on the meta device: the FP8 weight and
    its scales come out on the weight's device (a host allocation would land on the CPU)."""
    one = Axis(None, 0, 1)
    ctx = ParallelContext(
        tp=one, etp=one, ep=one, pp_rank=0, pp_size=1, layer_offset=0, num_local_experts=1, vocab_size=8
    )
    fp8 = BlockFP8(128, 128)
    kinds = [
        (ColumnParallel("decoder.layers.*.fc", "model.layers.*.mlp.up_proj.weight"), (512, 256)),
        (RowParallel("decoder.layers.*.proj", "model.layers.*.self_attn.o_proj.weight"), (256, 384)),
        (
            GatedColumn(
                "decoder.layers.*.fc1", "model.layers.*.mlp.gate_proj.weight", "model.layers.*.mlp.up_proj.weight"
            ),
            (512, 256),
        ),
    ]
    for mapping, shape in kinds:
        weight = torch.empty(shape, dtype=torch.bfloat16, device="meta")
        out = dict(mapping.export(weight, ctx, (3,), fp8))
        assert out and all(t.device.type == "meta" for t in out.values()), mapping
        assert {t.dtype for n, t in out.items() if not n.endswith("_scale_inv")} == {torch.float8_e4m3fn}
        assert all(n + "_scale_inv" in out for n in out if not n.endswith("_scale_inv"))
