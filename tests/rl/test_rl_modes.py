"""End-to-end RL runs with Ray on CPU, one per mode: real Megatron ranks (EP2, gloo) as Ray actors,
a real embedded engine, real weight syncs. Each run: a few steps of a tiny model.

Proves: every prompt group is trained on exactly once or counted as dropped (with a reason); the
staleness bound of each mode holds; one_step_off never mixes versions in a sample; the R3 metrics
and expert-load metrics are in the run's metrics; routers frozen by trainer.moe.freeze_router come out
of the run bit-equal; the final HF checkpoint is served by the embedded engine.
"""

from __future__ import annotations

import asyncio
import json
import math
import os

import pytest
import torch

from moe_rl.config import RunConfig, from_dict
from moe_rl.engine.sampling import SamplingParams
from moe_rl.rollout.expert_load import read_expert_load
from tests.agents.conftest import CHAT_DIR
from tests.tiny_models import QWEN3_MOE_SMALL, hf_config, hf_fields, save_random_model

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
STEPS = 4
PROBE_BOUND = 1e-4
"""|engine - trainer| logprob on the same weights, tokens and routing (R3), both in fp32: transformers'
forward against megatron-core's differ only in the order of sums (GEMM blocking, attention and norm
formulas, the EP2 all-to-all's expert sums). fp32's unit roundoff is u = 2^-24 ~ 6e-8; a dot product
of length n <= 128 (the tiny model's widest) is off by at most ~n u ~ 8e-6 relative, and a logprob
(a logit minus a log-sum-exp over 256 tokens) passes ~10 such products in 2 layers: under 1e-4 in
the worst case, ~1e-6 typically. A policy step moves logprobs by ~1e-2 (lr 1e-3 here)."""


def tiny_config(
    tmp_path, mode: str, rollout: dict | None = None, model: dict | None = None, trainer: dict | None = None, **rl
) -> RunConfig:
    return from_dict(
        RunConfig,
        {
            "model": {"hf_config": hf_fields(QWEN3_MOE_SMALL, max_position_embeddings=64), **(model or {})},
            "trainer": {
                "world_size": 2,
                "ep": 2,
                "micro_batch_size": 4,
                "global_batch_size": 8,
                "routing_replay": True,
                **(trainer or {}),
            },
            "rollout": {
                "task": "copy_digits_long_tail",
                "task_options": {"num_stop_tokens": 40},
                "groups_per_step": 4,
                "n_samples_per_prompt": 2,
                "max_new_tokens": 12,
                "max_staleness": 2,
                **(rollout or {}),
            },
            "sync": {"pause_mode": "abort", "bucket_bytes": 1 << 20},
            "rl": {"mode": mode, "report": False, "save_hf": False, **rl},
            "steps": STEPS,
            "output_dir": str(tmp_path / mode),
        },
    )


def run(config: RunConfig) -> tuple[dict, list[dict]]:
    from moe_rl.jobs import rl

    summary = rl.run(config)
    rows = [json.loads(line) for line in open(f"{config.output_dir}/metrics.jsonl")]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    return summary, rows


def check_utilization(rows: list[dict]) -> None:
    """perf/*: fractions in [0, 1]; trainer busy + wait, and engine busy + paused + idle, add up to
    the step's wall time; the engines did work."""
    for r in rows:
        step = r["time/step_s"]
        for key in ("perf/trainer_busy_frac", "perf/engine_busy_frac", "perf/engine_idle_frac"):
            assert 0.0 <= r[key] <= 1.0, (key, r[key])
        assert r["perf/trainer_busy_frac"] * step + r["perf/trainer_wait_s"] == pytest.approx(step)
        assert (r["perf/engine_busy_frac"] + r["perf/engine_idle_frac"]) * step + r[
            "perf/engine_paused_s"
        ] == pytest.approx(step)
        assert r["perf/engine_paused_s"] == pytest.approx(min(step, r["time/sync_s"]))
    # the engines did work: tokens were generated (busy time net of the sync pause can round to 0 on a
    # fast machine, where a tiny round takes less than the pause)
    assert rows[-1]["rollout/generated_tokens"] > 0


def check_ledger(summary: dict, groups: int = 4, steps: int = STEPS) -> None:
    """Trained exactly once, or dropped exactly once with a reason; nothing else."""
    ledger, trained = summary["ledger"], summary["trained_group_ids"]
    assert len(trained) == len(set(trained)) == steps * groups
    assert set(trained) == set(ledger["delivered"])
    assert not set(ledger["delivered"]) & set(ledger["dropped"])
    assert set(ledger["started"]) == set(ledger["delivered"]) | set(ledger["dropped"])
    assert all(
        reason in {"stale", "stopped", "unused", "oversampled", "zero_variance"}
        for reason in ledger["dropped"].values()
    )


def check_trace(run_dir, rows: list[dict]) -> list[dict]:
    """The step timeline (`trace.json`, rl.trace_steps=5 by default: steps 2..STEPS here): every
    process has its lane, each traced step holds the driver's and every trainer rank's spans in
    their order, and the engine's forwards are at most one per generated token (the trace's cost
    grows with the work, one tuple a span). Returns the spans."""
    from moe_rl.trace import read_trace

    spans = read_trace(run_dir / "trace.json")
    processes = {s["process"] for s in spans}
    assert processes == {"driver", "trainer rank 0", "trainer rank 1", "rollout worker", "engine-0"}, processes
    steps = sorted((s for s in spans if s["lane"] == "steps"), key=lambda s: s["start"])
    assert [s["name"] for s in steps] == [f"step {i}" for i in range(2, STEPS + 1)]
    for step in steps:
        inside = [s for s in spans if step["start"] <= s["start"] and s["end"] <= step["end"] + 1e-6]
        driver = [
            s
            for s in sorted(inside, key=lambda s: s["start"])
            if s["lane"] == "MainThread" and s["process"] == "driver"
        ]
        names = [s["name"] for s in driver]
        assert [name for name in names if name != "log"][:3] == ["wait for batch", "train", "weight sync"], names
        # the previous step's row is written while this step trains (the last step's at its end)
        (train,) = (s for s in driver if s["name"] == "train")
        logs = [s for s in driver if s["name"] == "log"]
        assert (
            len(logs) == 1 + (step is steps[-1])
            and train["start"] <= logs[0]["start"] <= logs[0]["end"] <= train["end"]
        )
        for rank in ("trainer rank 0", "trainer rank 1"):
            names = [s["name"] for s in inside if s["process"] == rank]
            for name in ("batch transfer", "train step", "forward-backward", "optimizer", "weight sync"):
                assert name in names, (rank, name, names)
        # the sync source's phases, in order, inside its weight sync
        phases = [s["name"] for s in sorted(inside, key=lambda s: s["start"]) if s["lane"] == "weight sync phases"]
        assert phases == ["sync pause", "sync buckets", "sync commit", "sync resume"], phases
        assert "update_weight_version" in [s["name"] for s in inside if s["process"] == "engine-0"]
    forwards = [s for s in spans if s["process"] == "engine-0" and s["name"] in ("decode", "prefill")]
    assert 0 < len(forwards) <= rows[-1]["rollout/generated_tokens"]
    return spans


@pytest.mark.parametrize("mode, bound", [("sync", 0), ("one_step_off", 1)])
def test_sync_and_one_step_off(tmp_path, mode, bound):
    summary, rows = run(tiny_config(tmp_path, mode, trainer={"consistency_probe_every": STEPS}))
    check_ledger(summary)
    # the consistency probe of the last step, on its version, at the arithmetic's level (PROBE_BOUND)
    assert [r["step"] for r in rows if "consistency/probe/skipped" in r] == [STEPS]
    assert rows[-1]["consistency/probe/skipped"] == 0 and rows[-1]["consistency/probe/logprob_diff_max"] < PROBE_BOUND
    check_utilization(rows)
    assert max(r["rollout/staleness_max"] for r in rows) <= bound
    # generation was never cut mid-sample: drained (one_step_off) or not admitted (sync)
    assert all(r["rollout/partial_samples"] == 0 for r in rows)
    assert all(r["train/skipped"] == 0 for r in rows)
    if mode == "one_step_off":
        assert all("time/drain_s" in r for r in rows)
    spans = check_trace(tmp_path / mode, rows)
    if mode == "sync":  # staleness 0: the engine never generates while a rank trains (one clock shows it)
        forwards = [s for s in spans if s["name"] in ("decode", "prefill")]
        for train in (s for s in spans if s["name"] == "train step"):
            assert not [f for f in forwards if f["start"] < train["end"] and train["start"] < f["end"]]


def test_the_batch_stays_off_the_driver(tmp_path):
    """The rollout worker builds the tensors (routing rows included) and the ranks resolve their
    ObjectRef: the driver receives under 1% of the batch's tensor bytes per step, and the run trains.
    16 responses of up to 320 tokens (one stop token in 256: the longest is under 180 tokens with
    probability 1e-5), so the tensors outweigh the metadata as they do at real lengths."""
    hf = hf_fields(QWEN3_MOE_SMALL, max_position_embeddings=512)
    rollout = {"task_options": {"num_stop_tokens": 1}, "max_new_tokens": 320, "groups_per_step": 8}
    summary, rows = run(tiny_config(tmp_path, "sync", rollout, {"hf_config": hf}, {"global_batch_size": 16}))
    check_ledger(summary, groups=8)
    check_utilization(rows)
    assert all(r["train/skipped"] == 0 and r["train/tokens"] > 0 for r in rows)
    for r in rows:
        fraction = r["perf/driver_batch_bytes"] / r["perf/batch_tensor_bytes"]
        print(f"step {r['step']}: driver {r['perf/driver_batch_bytes']} B, batch {r['perf/batch_tensor_bytes']} B")
        assert 0 < fraction < 0.01, (r["step"], fraction)


def test_sync_on_a_verl_parquet_dataset(tmp_path):
    """verl's RL layout trains unchanged: chat prompts rendered with the tiny chat template, the
    reference answer at `reward_model.ground_truth`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {
            "data_source": "digits",
            "prompt": [{"role": "user", "content": f"{i}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i)},
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(10)
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    dataset = {"task": "dataset", "task_options": {}, "dataset": str(tmp_path / "train.parquet")}
    rollout = {**dataset, "answer_key": "reward_model.ground_truth", "max_new_tokens": 4}
    summary, rows = run(tiny_config(tmp_path, "sync", rollout, {"tokenizer": str(CHAT_DIR)}))
    check_ledger(summary)
    assert rows[-1]["rollout/generated_tokens"] > 0 and "rollout/reward_mean" in rows[-1]


def test_fp8_weight_sync(tmp_path):
    """sync.fp8_blocks: the engines start from an FP8 checkpoint and every sync sends FP8 blocks;
    the engine then serves the dequantized weights (the logprob gap to the fp32 trainer shows it)."""
    config = tiny_config(tmp_path, "sync", trainer={"consistency_probe_every": 2})
    config.sync.fp8_blocks = 8
    summary, rows = run(config)
    check_ledger(summary)
    initial = json.loads((tmp_path / "sync" / "initial_hf" / "config.json").read_text())
    assert initial["quantization_config"]["weight_block_size"] == [8, 8]
    assert all(0 < r["offpolicy/logprob_diff_mean"] < 0.5 for r in rows)
    # on the same version and tokens the probe sees FP8's rounding: far above fp32's arithmetic
    probed = [r for r in rows if "consistency/probe/logprob_diff_mean" in r]
    assert len(probed) == 2 and all(r["consistency/probe/logprob_diff_mean"] > 10 * PROBE_BOUND for r in probed)


@pytest.mark.parametrize("transport", ["broadcast", "disk"])
def test_delta_weight_sync(tmp_path, transport):
    """sync.delta: the first sync an anchor, then deltas (in broadcast buckets, or as delta files the
    embedded engine resolves from storage); every step's probe (engine and trainer on the same
    version) sees the same weights, to the arithmetic's level: the deltas rebuilt them exactly."""
    config = tiny_config(tmp_path, "sync", trainer={"consistency_probe_every": 1})
    config.sync.delta.enabled = True
    if transport == "disk":
        config.sync.transport, config.sync.disk_dir = "disk", str(tmp_path / "versions")
    summary, rows = run(config)
    check_ledger(summary)
    assert [r["delta/anchor"] for r in rows] == [1.0, 0.0, 0.0, 0.0]
    for r in rows:
        # a step whose groups all tied trains on zero advantages and may change nothing: 0 is valid
        assert 0 <= r["delta/changed_fraction"] <= 1 and r["delta/wire_bytes"] > 0
        assert r["consistency/probe/skipped"] == 0 and r["consistency/probe/logprob_diff_max"] < PROBE_BOUND, r


def test_fully_async_partial_rollouts_r3_probe_expert_load_and_frozen_routers_in_the_final_checkpoint(tmp_path):
    """From a checkpoint at model.path with trainer.moe.freeze_router: the routers of `final_hf` are
    the loaded ones, bit for bit, while the rest trained; the expert load is logged every step; the
    consistency probe runs every other step."""
    from safetensors.torch import load_file

    hf_dir = save_random_model(hf_config(QWEN3_MOE_SMALL, max_position_embeddings=64), tmp_path / "hf")
    trainer = {
        "no_replay_forward_every": 2,
        "consistency_probe_every": 2,
        "consistency_probe_samples": 3,
        "moe": {"freeze_router": True},
    }
    # a group whose samples tie has zero GRPO advantage: regenerate it, so every step trains on a
    # signal whatever the random rewards (all 16 groups of one-digit copies tied in one CI run)
    rollout = {"task_options": {"num_stop_tokens": 40, "length": 6}, "drop_zero_variance_groups": True}
    config = tiny_config(
        tmp_path,
        "fully_async",
        rollout,
        model={"path": str(hf_dir), "hf_config": None},
        trainer=trainer,
        save_hf=True,
        report=True,
    )
    summary, rows = run(config)
    check_ledger(summary)
    # the routing-off forward (and its metrics) on steps 2 and 4 only
    routing_off = (
        "routing/agreement/layer0",
        "offpolicy/logprob_diff_no_replay_mean",
        "time/no_replay_forward_s",
        "experts/trainer/max_violation/layer1",
    )
    assert [r["step"] for r in rows if all(key in r for key in routing_off)] == [2, 4]
    assert not any(key in r for r in rows[::2] for key in routing_off)
    # the probe on steps 2 and 4, on the engines' current version: the gap is the arithmetic's
    probed = [r for r in rows if "consistency/probe/logprob_diff_max" in r]
    assert [r["step"] for r in probed] == [2, 4] and all(r["consistency/probe/skipped"] == 0 for r in probed)
    for r in probed:
        print(
            f"step {r['step']}: probe {r['consistency/probe/logprob_diff_max']:.2e} offpolicy "
            f"{r['offpolicy/logprob_diff_mean']:.2e} agreement {r['consistency/probe/routing_agreement']:.3f}"
        )
        assert 0 <= r["consistency/probe/logprob_diff_mean"] <= r["consistency/probe/logprob_diff_max"] < PROBE_BOUND
        assert 0.0 <= r["consistency/probe/routing_agreement"] <= 1.0 and r["time/consistency_probe_s"] > 0
        assert r["consistency/probe/tokens"] >= 3  # 3 sequences of at least one scored token
    # the cross-version gaps live under offpolicy/ only (docs/algorithm.md lists the move)
    assert not [k for r in rows for k in r if k.startswith("consistency/logprob") or k == "policy/logprob_diff_abs"]
    check_utilization(rows)
    assert max(r["rollout/staleness_max"] for r in rows) <= 2
    last = rows[-1]
    for key in (
        "routing/agreement/layer0",
        "routing/agreement/layer1",
        "offpolicy/logprob_diff_mean",
        "offpolicy/logprob_diff_no_replay_mean",
        "offpolicy/logprob_diff_abs",
        "policy/clip_fraction",
        "train/grad_norm",
        "time/sync_s",
        "rollout/generated_tokens_per_s",
        "buffer/backpressure_s",
    ):
        assert key in last, key
    assert 0.0 <= last["routing/agreement/layer0"] <= 1.0
    # the rollout's expert load, every step: top-2 of 4 experts, so max / mean - 1 lies in [0, 4 / 2 - 1]
    for r in rows:
        for layer in (0, 1):
            assert 0.0 <= r[f"experts/max_violation/layer{layer}"] <= 1.0
            assert 0.0 < r[f"experts/entropy/layer{layer}"] <= math.log(4) + 1e-9
        assert "experts/max_violation_mean" in r
    check_trace(tmp_path / "fully_async", rows)
    load = read_expert_load(tmp_path / "fully_async")
    assert [row["step"] for row in load] == [1, 2, 3, 4] and all(row["layers"] == [0, 1] for row in load)
    # the RL job's own plots
    assert {p.name for p in (tmp_path / "fully_async" / "plots").iterdir()} >= {
        "reward.png",
        "time.png",
        "utilization.png",
        "experts.png",
        "timeline.png",
    }
    # frozen routers: bit-equal to the loaded checkpoint in final_hf; the attention trained
    loaded = load_file(next(hf_dir.glob("*.safetensors")))
    final = {
        k: v for f in (tmp_path / "fully_async" / "final_hf").glob("*.safetensors") for k, v in load_file(f).items()
    }
    gates = [name for name in loaded if name.endswith("mlp.gate.weight")]
    assert len(gates) == 2 and all(torch.equal(final[name], loaded[name]) for name in gates)
    assert all(r["train/grad_norm"] > 0 for r in rows)
    assert not torch.equal(
        final["model.layers.0.self_attn.o_proj.weight"], loaded["model.layers.0.self_attn.o_proj.weight"]
    )
    # the final checkpoint is servable by the embedded engine
    from moe_rl.engine.client import EngineClient
    from moe_rl.engine.process import EmbeddedConfig, launch_embedded

    with launch_embedded(
        EmbeddedConfig(model_path=tmp_path / "fully_async" / "final_hf", weight_version="7", threads=1)
    ) as engine:

        async def generate():
            client = EngineClient(engine.url)
            try:
                return await client.generate([1, 13, 2], SamplingParams(max_new_tokens=4, temperature=0.0))
            finally:
                await client.close()

        result = asyncio.run(generate())
    assert len(result.output_ids) == 4 and result.weight_version == 7
