"""`moe-rl bench train`'s pieces: the length spec, the synthetic rollout batch, the padding each
batching path computes on the issue's long-tail distribution (no timing: the plan alone), and
one bench run end to end (its JSON; the speed figures are the bench's, never asserted)."""

from __future__ import annotations

import json

import pytest

from moe_rl.algorithms import AlgorithmConfig
from moe_rl.rollout.train_batch import build_batch
from moe_rl.trainer.microbatches import budget_plan, row_lengths
from moe_rl.trainer.throughput import LengthSpec, computed_inputs, synthetic_groups


def test_length_spec_parses_and_refuses():
    assert LengthSpec.parse("rows=8,cap=64,sigma=0.5") == LengthSpec(rows=8, cap=64, sigma=0.5)
    for bad in ("rows=0", "median=500,cap=100", "size=3", "rows=x"):
        with pytest.raises(ValueError, match="--lengths"):
            LengthSpec.parse(bad)
    lengths = LengthSpec(rows=512).response_lengths()
    assert len(lengths) == 512 and max(lengths) <= 384 and min(lengths) >= 1


def test_synthetic_groups_make_a_trainer_batch_of_the_spec_lengths():
    spec = LengthSpec(rows=16, cap=40, median=10)
    groups = synthetic_groups(spec, vocab_size=256, routing=(2, 2, 4))
    batch, info = build_batch(groups, AlgorithmConfig(), version=0)
    assert batch.tokens.shape == (16, spec.prompt + max(spec.response_lengths()))
    assert batch.routed_experts.dtype.itemsize == 1  # uint8: 4 experts
    assert info.response_lengths == spec.response_lengths()


def test_token_budget_padding_on_the_long_tail_is_under_five_percent():
    """The issue's target: on DAPO-like lengths (here 40x smaller, 512 rows), padding a whole batch
    to its longest row computes ~78% padding; token-budget micro-batches at most 5% (DP 2)."""
    spec = LengthSpec()
    batch, _ = build_batch(synthetic_groups(spec, vocab_size=256), AlgorithmConfig(), version=0)
    real = sum(spec.prompt + n - 1 for n in spec.response_lengths())
    padded = 1 - real / computed_inputs(batch.tensors(), dp_size=2, micro_batch_size=4, budget=None, multiple=1)
    dynamic = 1 - real / computed_inputs(batch.tensors(), dp_size=2, micro_batch_size=4, budget=1024, multiple=1)
    assert padded > 0.7 and dynamic <= 0.05, (padded, dynamic)


@pytest.mark.world  # spawns two trainer worlds (tests/conftest.py)
def test_bench_train_writes_both_paths(tmp_path, capsys):
    from moe_rl import cli

    out = tmp_path / "bench.json"
    argv = ["bench", "train", "configs/bench/train_long_tail.yaml", "trainer.max_tokens_per_microbatch=96"]
    argv += ["--lengths", "rows=16,cap=48,median=12"]
    assert cli.main([*argv, "--steps", "1", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    for path in ("padded", "dynamic"):
        assert set(result[path]) >= {"real_tokens_per_s", "padding_fraction", "peak_memory_bytes", "step_s"}
        assert 0 <= result[path]["padding_fraction"] < 1
    assert result["dynamic"]["padding_fraction"] < result["padded"]["padding_fraction"]
    assert 0 < result["driver_bytes_fraction"] < 0.05
    assert "skipped" in result["packed"]  # no Transformer Engine on CPU


def test_packed_inputs_are_the_real_ones_up_to_the_sequence_parallel_multiple():
    spec = LengthSpec(rows=64)
    batch, _ = build_batch(synthetic_groups(spec, vocab_size=256), AlgorithmConfig(), version=0)
    real = sum(spec.prompt + n - 1 for n in spec.response_lengths())
    assert computed_inputs(batch.tensors(), 2, 4, budget=1024, multiple=1, packed=True) == real
    with_sp = computed_inputs(batch.tensors(), 2, 4, budget=1024, multiple=4, packed=True)
    micro_batches = sum(len(rank) for rank in budget_plan(row_lengths(batch.tensors()), 2, 1024, 4))
    assert real <= with_sp <= real + 3 * micro_batches
