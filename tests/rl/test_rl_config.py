"""RL sections of the run config: validated before any process starts; modes set the staleness."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moe_rl.config import load_config
from moe_rl.report import write_comparison, write_report
from moe_rl.rollout.expert_load import write_expert_load
from moe_rl.trace import write_trace

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

DEMO = "configs/demo_cpu.yaml"


def test_demo_config_is_rl_and_modes_set_staleness():
    config = load_config(DEMO)
    assert config.is_rl and config.rl.mode == "fully_async"
    assert config.effective_rollout().max_staleness == config.rollout.max_staleness
    with pytest.warns(UserWarning, match="ignored"):
        assert load_config(DEMO, ["rl.mode=sync"]).effective_rollout().max_staleness == 0
    assert load_config(DEMO, ["rl.mode=one_step_off", "rollout.max_staleness=1"]).rl.drain_before_sync
    assert not load_config("configs/smoke_cpu.yaml").is_rl


@pytest.mark.parametrize(
    "override, field",
    [
        ("trainer.global_batch_size=32", "trainer.global_batch_size"),
        ("rollout.max_staleness=0", "max_staleness"),
        ("rl.mode=async", "rl.mode"),
        ("algorithm.kl_coef=-0.1", "algorithm.kl_coef"),
        ("engines.count=0", "engines.count"),
        ("rollout.return_routed_experts=false", "routing_replay"),
        ("sync.pause_mode=stop", "pause_mode"),
        ("algorithm.num_mini_batches=3", "algorithm.num_mini_batches"),  # 64 rows, micro 32 x dp 1
        ("algorithm.clip_ratio_c=0.5", "algorithm.clip_ratio_c"),
        ("sync.fp8_blocks=0", "fp8_blocks"),
        ("rl.trace_steps=-1", "rl.trace_steps"),
    ],
)
def test_bad_rl_settings_name_the_field(override, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        load_config(DEMO, [override])


@pytest.mark.parametrize("name", ["mask_stale_tokens", "drop_zero_variance_groups"])
def test_filtering_options_are_the_rollouts_only(name):
    # one owner each: the rollout (masks at generation / drops and refills at generation)
    assert getattr(load_config(DEMO, [f"rollout.{name}=true"]).rollout, name) is True
    # the old place is refused in one line that names the new one
    with pytest.raises(ValueError, match=rf"^config field 'algorithm\.{name}' is now rollout\.{name} .*: set that"):
        load_config(DEMO, [f"algorithm.{name}=true"])


def test_off_policy_none_needs_staleness_zero():
    with pytest.raises(ValueError, match="off_policy"):
        load_config(DEMO, ["algorithm.off_policy=none"])
    load_config(DEMO, ["algorithm.off_policy=none", "rl.mode=sync", "rollout.max_staleness=0"])


def test_report_writes_every_plot(tmp_path):
    rows = [
        {
            "step": s,
            "rollout/reward_mean": s / 10,
            "rollout/staleness_count/0": 3,
            "rollout/staleness_count/1": s,
            "routing/agreement/layer0": 0.9,
            "routing/agreement/layer1": 0.8,
            "time/trainer_wait_s": 0.1,
            "time/train_step_s": 0.2,
            "time/sync_s": 0.05,
            "perf/trainer_busy_frac": 0.7,
            "perf/engine_busy_frac": 0.5,
            "perf/engine_idle_frac": 0.3,
        }
        for s in range(1, 6)
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    names = {p.name for p in write_report(tmp_path)}
    assert names == {"reward.png", "staleness.png", "routing_agreement.png", "time.png", "utilization.png"}
    # speculative rollout: its curves per run, and two runs side by side
    other = tmp_path / "frozen"
    other.mkdir()
    for run_dir, accept in ((tmp_path, 0.8), (other, 0.4)):
        spec = [
            {**r, "rollout/spec_accept_rate": accept, "rollout/spec_tokens_per_forward": 1 + 2 * accept} for r in rows
        ]
        (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in spec))
    assert "speculation.png" in {p.name for p in write_report(tmp_path)}
    assert write_comparison([tmp_path, other]) == tmp_path / "plots" / "speculation_runs.png"
    assert (tmp_path / "plots" / "speculation_runs.png").stat().st_size > 0
    for step in range(1, 6):  # the routing's layer x expert load (layer 0 dense)
        write_expert_load(tmp_path, step, [1, 2], np.array([[step, 4, 4, 4], [8, 0, 2, 2]]))
    assert "experts.png" in {p.name for p in write_report(tmp_path)}
    # with a step timeline (trace.json): two steps of a driver, a trainer rank and an engine
    recorded = [
        {
            "process": "driver",
            "events": [(f"step {i}", i, i + 1, "steps", None, {}) for i in (2, 3)],
            "cpu_s": 0.1,
            "wall_s": 2,
        },
        {
            "process": "trainer rank 0",
            "events": [("train step", i + 0.1, i + 0.6, "MainThread", None, {}) for i in (2, 3)],
        },
        {
            "process": "engine-0",
            "events": [("decode", i + 0.2, i + 0.3, "scheduler", None, {"rows": 8}) for i in (2, 3)],
        },
    ]
    write_trace(tmp_path / "trace.json", recorded)
    assert "timeline.png" in {p.name for p in write_report(tmp_path)}
    # the probe's gap (every other step) against the off-policy gap (every step, one step at 0: off the log axis)
    gaps = [{"offpolicy/logprob_diff_mean": 0.02 * (s > 1)} for s in range(1, 6)]
    for gap in gaps[1::2]:
        gap.update({"consistency/probe/logprob_diff_mean": 1e-7, "consistency/probe/logprob_diff_max": 5e-7})
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps({**r, **g}) for r, g in zip(rows, gaps)))
    assert "consistency.png" in {p.name for p in write_report(tmp_path)}
    agents = {
        "agents/turns_per_episode": 2.0,
        "agents/tool_calls_per_episode": 1.0,
        "agents/env_s_per_episode": 0.1,
        "agents/generate_s_per_episode": 0.2,
        "rollout/trained_tokens": 10,
        "rollout/masked_tokens": 30,
    }
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps({**r, **agents}) for r in rows))
    assert {"agents.png", "agent_time.png"} <= {p.name for p in write_report(tmp_path)}
    with pytest.raises(ValueError, match="metrics.jsonl"):
        write_report(tmp_path / "missing")


def test_prompt_plus_max_new_tokens_beyond_the_context_fails_before_start(tmp_path, capsys, monkeypatch):
    import moe_rl.jobs.rl
    from moe_rl import cli

    def no_cluster(*args, **kwargs):
        raise AssertionError("the RL cluster started for a config whose requests cannot fit")

    monkeypatch.setattr(moe_rl.jobs.rl, "RLCluster", no_cluster)
    assert (
        cli.main(
            [
                "train",
                "configs/demo_cpu.yaml",
                "rollout.max_new_tokens=100",
                "steps=2",
                f"output_dir={tmp_path / 'run'}",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "rollout.max_new_tokens=100" in err and "max_position_embeddings 64" in err
