"""Full resume: SIGKILL the RL driver mid-run, `moe-rl train --resume RUN_DIR`, and the run finishes
with every completed group trained exactly once (or dropped with a reason), versions continuing,
and the metrics (and the expert load's rows) continuing from the checkpoint's step; the rollout dumps
(`rollout.dump`) hold every step once. Real Ray, Megatron (EP2, gloo), embedded engine.
Twice: single-turn samples, and multi-turn episodes of an OpenAI-SDK agent (the lookup task with a
tool that takes time), whose open episodes replay their finished turns after the resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from moe_rl import cli
from moe_rl.rollout.dump import SampleDump
from tests.tiny_models import QWEN3_MOE_SMALL, hf_fields

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

STEPS, GROUPS = 8, 4
HOLD = 6  # the first run cannot get past this step (its dump blocks): killed after checkpoint 3, 4 or 5
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled"}
CHAT_DIR = Path(__file__).resolve().parents[2] / "configs" / "tokenizers" / "tiny_chat"
SINGLE_TURN = {
    "model": {"hf_config": hf_fields(QWEN3_MOE_SMALL, max_position_embeddings=64)},
    "rollout": {"task": "copy_digits_long_tail", "task_options": {"num_stop_tokens": 40}, "max_new_tokens": 12},
}
EPISODES = {
    "model": {
        "hf_config": hf_fields(QWEN3_MOE_SMALL, vocab_size=128, eos_token_id=2, max_position_embeddings=128),
        "tokenizer": str(CHAT_DIR),
    },
    "rollout": {
        "task": "lookup",
        "task_options": {"latency_s": 0.05},
        "agent": "moe_rl.tasks.lookup:lookup_openai_agent",
        "max_new_tokens": 2,
        "episode": {"max_context_tokens": 128},
    },
}


def write_config(path: Path, run_dir: Path, kind: dict) -> None:
    path.write_text(
        yaml.safe_dump(
            {
                "model": kind["model"],
                "trainer": {
                    "world_size": 2,
                    "ep": 2,
                    "micro_batch_size": 2,
                    "global_batch_size": 8,
                    "routing_replay": True,
                },
                "algorithm": {"num_mini_batches": 2},  # two optimizer steps per weight version, across the resume too
                "rollout": {
                    **kind["rollout"],
                    "groups_per_step": GROUPS,
                    "n_samples_per_prompt": 2,
                    "max_staleness": 2,
                    "dump": True,
                },
                "sync": {"pause_mode": "abort", "bucket_bytes": 1 << 20},
                "rl": {
                    "mode": "fully_async",
                    "report": False,
                    "save_hf": False,
                    "checkpoint_every": 1,
                    # each step's checkpoint in place before the next step: the first run holds at
                    # step HOLD, where a background write would never be put into place
                    "checkpoint_background": False,
                    "keep_checkpoints": 2,
                },
                "steps": STEPS,
                "output_dir": str(run_dir),
            }
        )
    )


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


@pytest.mark.parametrize("kind", [SINGLE_TURN, EPISODES], ids=["single_turn", "agent_episodes"])
def test_sigkill_then_resume_loses_nothing_and_trains_nothing_twice(tmp_path, kind):
    config, run_dir = tmp_path / "run.yaml", tmp_path / "run"
    write_config(config, run_dir, kind)
    driver = subprocess.Popen(
        [sys.executable, "-m", "moe_rl.cli", "train", str(config)],
        env=ENV,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "first.err", "w"),
    )
    try:
        deadline = time.monotonic() + 240
        # the kill must land mid-run however fast this machine is: the driver writes step HOLD's
        # rollout dump through a temp file named by its pid; made a FIFO once the run directory is
        # the driver's (before Ray and the cluster start), its open() blocks until the kill
        while not (run_dir / "config.json").is_file():
            assert driver.poll() is None, (tmp_path / "first.err").read_text()[-3000:]
            assert time.monotonic() < deadline, "the first run did not start"
            time.sleep(0.02)
        (run_dir / "rollouts").mkdir(exist_ok=True)
        os.mkfifo(run_dir / "rollouts" / f".step_{HOLD:06d}.jsonl.{driver.pid}.tmp")
        while not list((run_dir / "checkpoints").glob("step_00000[3-9]")):  # past max_staleness
            assert driver.poll() is None, (tmp_path / "first.err").read_text()[-3000:]
            assert time.monotonic() < deadline, "the first run made no progress"
            time.sleep(0.2)
        os.kill(driver.pid, signal.SIGKILL)  # the driver only, mid-run
        driver.wait()
    finally:
        os.killpg(driver.pid, signal.SIGKILL)  # then what it left behind (Ray, actors, engine), by our group id
    killed_rows = rows(run_dir / "metrics.jsonl")
    killed_load = rows(run_dir / "experts.jsonl")
    assert len(killed_rows) < STEPS
    checkpoints = sorted(p for p in (run_dir / "checkpoints").glob("step_*") if not p.name.endswith(".tmp"))
    resumed_from = json.loads((checkpoints[-1] / "state.json").read_text())
    at_kill = json.loads((checkpoints[-1] / "rollout.json").read_text())
    k = resumed_from["step"]
    dump = SampleDump(run_dir / "rollouts")
    kept_dumps = {step: dump.read(step) for step in range(1, k + 1)}

    done = subprocess.run(
        [sys.executable, "-m", "moe_rl.cli", "train", "--resume", str(run_dir)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
        start_new_session=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]

    # metrics: every step once, the resumed run continuing at k + 1
    metrics = rows(run_dir / "metrics.jsonl")
    assert [r["step"] for r in metrics] == list(range(1, STEPS + 1))
    assert metrics[:k] == killed_rows[:k]
    assert all("rollout/reward_mean" in r for r in metrics[k:])
    # the expert load (experts.jsonl) likewise: every step once, the killed run's first k rows kept
    load = rows(run_dir / "experts.jsonl")
    assert [r["step"] for r in load] == list(range(1, STEPS + 1)) and load[:k] == killed_load[:k]
    # trained groups: each exactly once over both runs; the killed run's first k steps kept
    trained = rows(run_dir / "trained.jsonl")
    assert [r["step"] for r in trained] == list(range(1, STEPS + 1))
    ids = [gid for r in trained for gid in r["groups"]]
    assert len(ids) == len(set(ids)) == STEPS * GROUPS
    assert {g for r in trained[:k] for g in r["groups"]} == set(at_kill["buffer"]["delivered"])
    # no completed group lost: what waited in the buffer at the checkpoint was trained after it,
    # dropped with a reason, or still waits at the end; what was generating went on under its id
    # (an episode of several turns may finish after younger ones and wait behind them)
    at_end = json.loads((run_dir / "checkpoints" / f"step_{STEPS:06d}" / "rollout.json").read_text())
    final = at_end["buffer"]
    after = {g for r in trained[k:] for g in r["groups"]}
    waiting = {group[0]["group_id"] for group in final["queued"]} | {group["group_id"] for group in at_end["open"]}
    for group in at_kill["open"]:
        gid = group["group_id"]
        assert gid in after or gid in final["dropped"] or gid in waiting, gid
    for group in at_kill["buffer"]["queued"]:
        gid = group[0]["group_id"]
        assert gid in after or final["dropped"].get(gid) == "stale" or gid in waiting, gid
    assert set(final["delivered"]) == set(ids)
    # rollout dumps: one file per step 1..STEPS (later ones removed at the resume and redone), each
    # group in exactly one step's file, the first k steps as the killed run wrote them
    assert sorted(p.name for p in dump.directory.iterdir()) == [f"step_{s:06d}.jsonl" for s in range(1, STEPS + 1)]
    records = {step: dump.read(step) for step in dump.steps()}
    assert {step: records[step] for step in range(1, k + 1)} == kept_dumps
    for row in trained:
        assert {r["group_id"] for r in records[row["step"]]} == set(row["groups"])
    dumped = [gid for step in records for gid in {r["group_id"] for r in records[step]}]
    assert len(dumped) == len(set(dumped)) == STEPS * GROUPS
    for record in (r for step in records.values() for r in step):
        assert record["response_text"] and isinstance(record["advantage"], float) and record["staleness"] <= 2
        assert record["versions"][-1][1] == record["response_tokens"] == len(record["response_ids"])
        # each sample's expert load: 2 MoE layers x 4 experts, top-2 of every token routed but the last
        routed = len(record["prompt_ids"]) + len(record["response_ids"]) - 1
        assert [sum(layer) for layer in record["expert_load"]] == [2 * routed, 2 * routed]
        assert (record["episode"] is not None) == (kind is EPISODES)
    assert cli.main(["samples", str(run_dir), "--worst", "--limit", "2"]) == 0
    assert not set(final["delivered"]) & set(final["dropped"])
    # versions continue: k > max_staleness, so had the engines restarted at version 0 every fresh
    # sample would be stale forever and the run could not finish; it did, from step k + 1
    assert k > 2 and len(metrics) == STEPS
    assert set(final["dropped"].values()) <= {"stale", "stopped", "unused", "oversampled"}, final["dropped"]
    assert len(list((run_dir / "checkpoints").glob("step_*"))) == 2  # keep-last-2
    if kind is EPISODES:
        assert sum(r["agents/episodes"] for r in metrics[k:]) > 0  # episodes went on after the resume
        assert all(r["agents/turns_per_episode"] >= 1 for r in metrics[k:] if r["agents/episodes"])
