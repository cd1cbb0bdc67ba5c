"""Trainer faults inside one job, on real processes (Ray, Megatron EP2 on gloo, the embedded engine).
FAULT INJECTION (named as such): the test itself SIGKILLs a trainer rank's Ray actor process, or
SIGSTOPs one so that it never enters the next collective, and SIGTERMs the `moe-rl train` driver.

- `make demo`'s config for 60 steps, a run checkpoint every 5, `rl.max_restarts=3`: three ranks
  killed at random steps; the run finishes with every step's row once and every group trained
  once (its reward beside a run without faults: benchmarks/RESULTS.md#trainer-faults).
- A rank that stops answering: the run ends within `rl.call_timeout_s` (+ the status round) with
  a message naming the rank and the call, when no restart is left.
- SIGTERM with `rl.checkpoint_every=0`: a run checkpoint at the end of a step, exit 75, and
  `--resume` finishes with every step once.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from moe_rl.config import load_config
from moe_rl.rl.resume import read_rows
from moe_rl.rl.stacks import read_processes
from tests.rl.test_rl_modes import check_ledger

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "demo_cpu.yaml"
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled"}


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def last_step(run_dir: Path) -> int:
    """The newest step logged; read while the run writes, so a row being appended is skipped."""
    return max((r["step"] for r in read_rows(run_dir / "metrics.jsonl")), default=0)


def pids(run_dir: Path, kind: str) -> dict[str, int]:
    """The pids of this start's processes whose names start with `kind` (processes.json)."""
    try:
        return {p.name: p.pid for p in read_processes(run_dir) if p.name.startswith(kind)}
    except (ValueError, json.JSONDecodeError):
        return {}


def rank_pids(run_dir: Path) -> dict[str, int]:
    return pids(run_dir, "trainer rank")


def pids_of_engines(run_dir: Path) -> dict[str, int]:
    return pids(run_dir, "engine-")


class Injector(threading.Thread):
    """FAULT INJECTION: at each of `steps` (once the run logged it), signal one trainer rank's
    process, then wait for the restarted ranks (new pids in processes.json) before the next."""

    def __init__(self, run_dir: Path, steps: list[int], sig: signal.Signals, rng: random.Random):
        super().__init__(daemon=True)
        self.run_dir, self.steps, self.sig, self.rng = run_dir, steps, sig, rng
        self.hit: list[tuple[int, str]] = []  # (last step logged, rank) per injected fault
        self.engines: dict[str, int] = {}  # the engines' pids before the first fault
        self.finished = threading.Event()

    def run(self) -> None:
        for step in self.steps:
            while last_step(self.run_dir) < step or not (pids := rank_pids(self.run_dir)):
                if self.finished.wait(0.05):
                    return
            self.engines = self.engines or pids_of_engines(self.run_dir)
            rank = self.rng.choice(sorted(pids))
            os.kill(pids[rank], self.sig)
            self.hit.append((last_step(self.run_dir), rank))
            while set(rank_pids(self.run_dir).values()) & set(pids.values()):  # the restarted world
                if self.finished.wait(0.05):
                    return


def test_three_trainer_ranks_killed_at_random_steps_the_run_finishes_exactly_once(tmp_path):
    from moe_rl.jobs import rl

    run_dir = tmp_path / "run"
    steps = 60
    config = load_config(
        str(DEMO),
        [f"steps={steps}", "rl.checkpoint_every=5", "rl.max_restarts=3", "rl.report=false", f"output_dir={run_dir}"],
    )
    rng = random.Random(os.getpid())
    kill_at = sorted(rng.sample(range(3, steps - 5, 8), 3))  # at least 8 steps apart
    injector = Injector(run_dir, kill_at, signal.SIGKILL, rng)
    injector.start()
    try:
        summary = rl.run(config)
    finally:
        injector.finished.set()
        injector.join()
    print(
        f"killed at {injector.hit}; faults {summary['faults']}; rewards {summary['reward_first']:.3f} -> "
        f"{summary['reward_last']:.3f}"
    )
    assert len(injector.hit) == 3
    metrics = rows(run_dir / "metrics.jsonl")
    assert [r["step"] for r in metrics] == list(range(1, steps + 1))  # each step's row once
    assert summary["faults"]["faults/trainer_restarts"] == 3 == metrics[-1]["faults/trainer_restarts"]
    # each fault redoes the steps logged since the newest complete checkpoint (every 5; a background
    # checkpoint still being written when the rank died is not one), from step 0 before the first
    resumed, hits = summary["resumed_from"], [step for step, _ in injector.hit]
    assert all(start % 5 == 0 and start <= hit for start, hit in zip(resumed, hits)), (injector.hit, resumed)
    assert resumed == sorted(resumed) and resumed[-1] > 0  # checkpoints were completed between the faults
    assert metrics[-1]["faults/steps_redone"] == sum(hit - start for start, hit in zip(resumed, hits))
    assert metrics[-1]["faults/restart_s"] > 0
    check_ledger(summary, config.rollout.groups_per_step, steps)  # every group trained once, or dropped once
    # the engines kept running through the faults, rolled back to each resumed version: no token
    # of a version the run discarded (it would be newer than the step's trainer: negative staleness)
    assert pids_of_engines(run_dir) == injector.engines and len(injector.engines) == config.engines.count
    assert not [key for row in metrics for key in row if key.startswith("rollout/staleness_count/-")]


def test_a_rank_that_stops_answering_is_named_with_the_call(tmp_path):
    from moe_rl.jobs import rl
    from moe_rl.rl.trainer_group import TrainerFault

    run_dir = tmp_path / "run"
    timeout_s = 30
    config = load_config(
        str(DEMO),
        [
            "steps=100",
            "rl.max_restarts=0",
            f"rl.call_timeout_s={timeout_s}",
            "rl.report=false",
            "rl.save_hf=false",
            f"output_dir={run_dir}",
        ],
    )
    injector = Injector(run_dir, [2], signal.SIGSTOP, random.Random(0))
    injector.start()
    try:
        with pytest.raises(TrainerFault) as raised:
            rl.run(config)
    finally:
        injector.finished.set()
        injector.join()
    ((_, rank),) = injector.hit
    message = str(raised.value)
    print(message)
    assert f"ranks [0, 1] did not answer within rl.call_timeout_s={timeout_s} s" in message
    assert f"rank {rank[-1]} does not answer" in message  # the stopped one; its peer waits in a collective
    assert "rl.max_restarts=0 restarts spent" in message and f"--resume {run_dir}" in message
    # the ranks' stacks, saved at the fault: the waiting rank inside its RL step; the stopped one
    # could not dump (a stopped process runs no handler) and says so
    stacks = (run_dir / "stacks" / "fault_1.txt").read_text()
    waiting = stacks.split(f"=== trainer rank {1 - int(rank[-1])}")[1].split("===")[0]
    assert "rl_step.py" in waiting, stacks
    assert "the process is stopped or not answering signals" in stacks.split(f"=== {rank}")[1].split("===")[0]
    assert last_step(run_dir) < 100


def test_sigterm_checkpoints_and_exits_75_then_resume_finishes(tmp_path):
    run_dir, steps = tmp_path / "run", 12
    command = [sys.executable, "-m", "moe_rl.cli", "train"]
    overrides = [f"steps={steps}", "rl.checkpoint_every=0", "rl.report=false", "rl.save_hf=false"]
    driver = subprocess.Popen(
        [*command, str(DEMO), *overrides, f"output_dir={run_dir}"],
        env=ENV,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        while last_step(run_dir) < 2:
            assert driver.poll() is None, driver.stdout.read()[-3000:]
            time.sleep(0.05)
        driver.send_signal(signal.SIGTERM)
        out, _ = driver.communicate(timeout=300)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    assert driver.returncode == 75, out[-3000:]
    checkpoints = sorted((run_dir / "checkpoints").glob("step_*"))
    assert len(checkpoints) == 1 and not checkpoints[0].name.endswith(".tmp")
    k = json.loads((checkpoints[0] / "state.json").read_text())["step"]
    assert [r["step"] for r in rows(run_dir / "metrics.jsonl")] == list(range(1, k + 1)) and 2 <= k < steps
    done = subprocess.run([*command, "--resume", str(run_dir)], env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert [r["step"] for r in rows(run_dir / "metrics.jsonl")] == list(range(1, steps + 1))
    trained = [g for r in rows(run_dir / "trained.jsonl") for g in r["groups"]]
    assert len(trained) == len(set(trained)) == steps * 8


def test_a_rollout_worker_control_call_has_a_deadline(tmp_path):
    """`RLCluster`'s calls to the rollout worker (admit, metrics, engine states, ...) take
    milliseconds; one that does not come back within rl.call_timeout_s is named."""
    import ray

    from moe_rl.rl.cluster import RLCluster

    @ray.remote
    class Wedged:
        def __init__(self):
            self.never = threading.Event()

        def engine_states(self) -> list:
            self.never.wait()  # wedged: never returns
            return []

    ray.init(num_cpus=1, include_dashboard=False)
    try:
        cluster = RLCluster.__new__(RLCluster)  # the deadline alone: no trainer, no engines
        cluster.config = load_config(str(DEMO), ["rl.call_timeout_s=1"])
        cluster.run_dir, cluster.rollout = tmp_path, Wedged.remote()
        with pytest.raises(RuntimeError, match=r"did not answer `engine_states` within rl.call_timeout_s=1 s"):
            cluster.engine_states()
    finally:
        ray.shutdown()
