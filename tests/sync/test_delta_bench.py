"""`moe-rl bench sync` with a `delta:` section (`moe_rl.bench.delta`) at a tiny size: the JSON's
fields, a chain equal bit for bit to the final weights in both formats, and how sparse bf16 is."""

from __future__ import annotations

import json

from moe_rl.bench import delta
from moe_rl.bench.options import DeltaBench, SyncBench
from parallel.layout import ParallelLayout
from tests.tiny_models import QWEN3_MOE_SMALL, config_kwargs


def test_delta_bench_chains_bit_equal_and_bf16_at_1e_6_is_sparse(tmp_path):
    output = tmp_path / "delta.json"
    options = SyncBench(
        model=config_kwargs(QWEN3_MOE_SMALL, num_hidden_layers=1),
        layout=ParallelLayout(),
        delta=DeltaBench(lrs=[1.0e-6], steps=5, full_every=3, fp8_blocks=16, batch_size=4, seq_len=8),
        output=str(output),
    )
    result = delta.run(options)
    assert json.loads(output.read_text()) == json.loads(json.dumps(result))
    assert [(r["lr"], r["format"]) for r in result["runs"]] == [(1.0e-6, "bf16"), (1.0e-6, "fp8")]
    assert result["machine"]["cores"] >= 1 and result["delta"]["steps"] == 5
    for run in result["runs"]:
        assert run["chain_bit_equal"] is True
        assert (run["anchors"], run["chain_steps"]) == (2, 1)  # anchors at steps 0 and 3
        assert [s["anchor"] for s in run["steps"]] == [True, False, False, True, False]
        for step in run["steps"]:
            assert set(step) >= {"changed_fraction", "wire_fraction", "encode_s", "apply_s", "kept_bytes"}
            assert step["kept_bytes"] > 0
        assert 0 <= run["changed_fraction_median"] < 1 and run["wire_fraction_median"] < 1
    # Adam moves each fp32 master by about lr per step (its update is normalised, whatever the
    # gradient's size); a bf16 value w changes when that crosses one of its rounding boundaries,
    # spaced 2^-8..2^-7 x |w| apart: ~lr / (|w| 2^-8) = 1e-6 / (0.02 x 0.004) ~ 1% of the weights
    # (initializer_range 0.02), plus the few within lr x 2^8 of zero. Half is a loose bound on that.
    bf16 = result["runs"][0]
    assert bf16["changed_fraction_median"] < 0.5
