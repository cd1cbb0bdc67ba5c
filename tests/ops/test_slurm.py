"""The SLURM path under a real SLURM (slurm-wlm 22.05 + munge on this machine, `slurm_cluster`):
`sbatch scripts/slurm/train.sbatch` with the CPU demo (as a CPU user submits it, and with the
header as written against a fake `gpu:8` node), `srun` + the torchrun scripts, `scancel` of a
running job, and preemption: USR1 to the batch shell checkpoints the run, requeues the job and
the job resumes it; a second signal ends it at once. Each job completes (or is cancelled) with
its metrics written and leaves no Ray, torchrun or trainer process and no Ray temp dir behind; a
local run starts afterwards."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from slurm_cluster import SlurmCluster, install_reason

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

REPO = Path(__file__).resolve().parents[2]
RAY_ADDRESS_FILE = Path("/tmp/ray/ray_current_cluster")


@pytest.fixture(scope="module")
def slurm():
    reason = install_reason()
    if reason is not None:
        pytest.skip(reason)
    cluster = SlurmCluster().start()
    try:
        yield cluster
    finally:
        cluster.stop()


def _job_env() -> dict[str, str]:
    with socket.socket() as s:  # a Ray port of its own (outside Ray's worker port range 10002-19999)
        s.bind(("", 0))
        port = s.getsockname()[1]
    return {"VENV": sys.prefix, "RAY_PORT": str(port)}


def _processes(marker: str) -> list[str]:
    """Command lines of live processes that mention `marker` (a job's temp dir or output dir)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        line = " ".join(proc.info["cmdline"] or [])
        if marker in line and proc.pid != os.getpid():
            found.append(line)
    return found


def _assert_nothing_left(*markers: str) -> None:
    deadline = time.monotonic() + 30  # slurmd has reaped the job; its processes exit within KillWait
    while any(_processes(m) for m in markers) and time.monotonic() < deadline:
        time.sleep(0.5)
    for marker in markers:
        assert not _processes(marker), _processes(marker)


def _address_file_state():
    return RAY_ADDRESS_FILE.stat().st_mtime_ns if RAY_ADDRESS_FILE.exists() else None


def _submit_demo(
    slurm: SlurmCluster, tmp_path: Path, extra_sbatch: list[str], steps: int, overrides: tuple[str, ...] = ()
) -> tuple[int, Path, Path]:
    run = tmp_path / "run"
    job = slurm.sbatch(
        [
            *extra_sbatch,
            "--nodes=1",
            f"--output={tmp_path}/moe-rl-%j.log",
            "scripts/slurm/train.sbatch",
            "configs/demo_cpu.yaml",
            f"steps={steps}",
            f"output_dir={run}",
            *overrides,
        ],
        cwd=REPO,
        env=_job_env(),
    )
    return job, run, tmp_path / f"moe-rl-{job}.log"


def _metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for_rows(slurm: SlurmCluster, job: int, run: Path, log: Path, rows: int, timeout_s: float = 600) -> None:
    """Until the running job's metrics hold `rows` rows (training is under way)."""
    deadline = time.monotonic() + timeout_s
    while len(_metrics(run)) < rows:
        assert slurm.job_state(job) in ("PENDING", "RUNNING"), log.read_text()[-3000:] if log.exists() else ""
        assert time.monotonic() < deadline, f"the job wrote fewer than {rows} metrics rows in {timeout_s} s"
        time.sleep(0.5)


def _check_finished_job(job: int, run: Path, log: Path, state: str, address_before) -> str:
    text = log.read_text()
    assert state == "COMPLETED", text[-3000:]
    assert not Path(f"/tmp/moe-rl-ray-{job}").exists()
    _assert_nothing_left(f"/tmp/moe-rl-ray-{job}", str(run))
    assert _address_file_state() == address_before  # the job wrote no address a later ray.init would find
    ray_log = REPO / f"moe-rl-{job}-ray.log"
    ray_text = ray_log.read_text()
    ray_log.unlink()
    for failure in ("srun: error", "exited unexpectedly", "Traceback"):  # a clean stop: no kill, no raylet dump
        assert failure not in ray_text, ray_text[-3000:]
    return text


def test_sbatch_cpu_demo(slurm, tmp_path):
    before = _address_file_state()
    job, run, log = _submit_demo(slurm, tmp_path, ["--gpus-per-node=0"], steps=12)
    text = _check_finished_job(job, run, log, slurm.wait_job(job, 900), before)
    assert "over 12 steps (fully_async)" in text
    assert "rl step 6/12 (" in text  # progress shows in the log while the job runs
    assert [m["step"] for m in _metrics(run)] == list(range(1, 13))
    gloo = text.split("gloo on ", 1)[1].split(")", 1)[0]  # a real interface name, never NCCL's "^lo,docker"
    assert gloo in psutil.net_if_addrs(), gloo
    head = text.split("Ray head ", 1)[1].split("(", 1)[1].split(":", 1)[0]
    routable = [
        a.address
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if a.family == socket.AF_INET and not a.address.startswith("127.")
    ]
    assert head in routable if routable else head.startswith("127."), head  # what other nodes can reach


def test_sbatch_header_as_written_on_a_gpu_node(slurm, tmp_path):
    """`--gpus-per-node=8` from the header against the fake gpu:8 node: Ray is told about 8 GPUs;
    the CPU config asks for none and runs."""
    before = _address_file_state()
    job, run, log = _submit_demo(slurm, tmp_path, [], steps=3)
    text = _check_finished_job(job, run, log, slurm.wait_job(job, 900), before)
    assert "1 nodes x 8 GPUs" in text
    assert len(_metrics(run)) == 3


def test_scancel_of_a_running_job_ends_it_clean(slurm, tmp_path):
    before = _address_file_state()
    job, run, log = _submit_demo(slurm, tmp_path, ["--gpus-per-node=0"], steps=100000)
    _wait_for_rows(slurm, job, run, log, 2)
    slurm.run(["scancel", str(job)])
    assert slurm.wait_job(job, 120) == "CANCELLED"
    assert not Path(f"/tmp/moe-rl-ray-{job}").exists()
    _assert_nothing_left(f"/tmp/moe-rl-ray-{job}", str(run))
    assert _address_file_state() == before
    assert len(_metrics(run)) >= 2  # what the run had written is still there
    (REPO / f"moe-rl-{job}-ray.log").unlink(missing_ok=True)


def test_usr1_checkpoints_requeues_and_the_job_resumes(slurm, tmp_path):
    """What the header's `--signal=B:USR1@300` does before the time limit: USR1 to the batch shell
    only. First a USR1 to every job step (not the shell), which Ray ignores: training goes on. Then
    USR1 to the batch shell: the driver checkpoints (rl.checkpoint_every=0: only on the signal),
    exits 75, Ray stops, the job requeues itself and its second start continues the run
    (--auto-resume) to the end: every step once, no group trained twice."""
    before = _address_file_state()
    steps = 60  # a demo step takes ~0.2 s: room for the signal to arrive before the last one
    job, run, log = _submit_demo(slurm, tmp_path, ["--gpus-per-node=0"], steps, ("rl.checkpoint_every=0",))
    _wait_for_rows(slurm, job, run, log, 2)
    slurm.run(["scancel", "--signal=USR1", str(job)])  # the steps, never the batch shell
    _wait_for_rows(slurm, job, run, log, len(_metrics(run)) + 1)  # Ray is still there
    slurm.run(["scancel", "--signal=USR1", "--batch", str(job)])
    text = _check_finished_job(job, run, log, slurm.wait_job(job, 900), before)
    assert slurm.job_field(job, "Restarts") == "1", text[-3000:]
    (checkpoint,) = (run / "checkpoints").iterdir()  # the signal's, and no other
    step = int(checkpoint.name.removeprefix("step_"))
    assert f"preempted by SIGUSR1: run checkpoint at step {step}/{steps}" in text
    assert f"moe-rl: job {job} requeued" in text and "requeued 1 x" in text
    assert f"over {steps} steps" in text
    assert [m["step"] for m in _metrics(run)] == list(range(1, steps + 1))
    trained = [json.loads(line)["groups"] for line in (run / "trained.jsonl").read_text().splitlines()]
    groups = [group for row in trained for group in row]
    assert len(groups) == len(set(groups))


def test_a_second_signal_ends_the_job_at_once_without_ray_left(slurm, tmp_path):
    """USR1 then TERM to the batch shell: the driver exits at once (no checkpoint, no requeue), then
    Ray stops; nothing of the job is left."""
    before = _address_file_state()
    job, run, log = _submit_demo(slurm, tmp_path, ["--gpus-per-node=0"], 100000, ("rl.checkpoint_every=0",))
    _wait_for_rows(slurm, job, run, log, 2)
    slurm.run(["scancel", "--signal=USR1", "--batch", str(job)])
    slurm.run(["scancel", "--signal=TERM", "--batch", str(job)])
    assert slurm.wait_job(job, 300) == "FAILED"
    assert slurm.job_field(job, "Restarts") == "0"
    assert not Path(f"/tmp/moe-rl-ray-{job}").exists()
    _assert_nothing_left(f"/tmp/moe-rl-ray-{job}", str(run))
    assert _address_file_state() == before
    ray_log = REPO / f"moe-rl-{job}-ray.log"
    assert "srun: error" not in ray_log.read_text()
    ray_log.unlink()


def test_srun_torchrun_train(slurm, tmp_path):
    run = tmp_path / "smoke"
    done = slurm.run(
        [
            "srun",
            "--nodes=1",
            "--gpus-per-node=0",
            "scripts/torchrun_train.sh",
            "configs/smoke_cpu.yaml",
            "trainer.world_size=2",
            "trainer.tp=1",
            "trainer.sequence_parallel=false",
            "steps=2",
            f"output_dir={run}",
        ],
        cwd=REPO,
        env={"NPROC": "2", "VENV": sys.prefix},
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("over 2 steps") == 1, done.stdout  # one summary, not one per rank
    assert len(_metrics(run)) == 2
    _assert_nothing_left(str(run))


def test_srun_torchrun_convert_round_trip(slurm, tmp_path):
    from transformers import AutoModelForCausalLM

    from moe_rl.config import load_config
    from parallel.hf_checkpoint import HFCheckpointReader

    hf = tmp_path / "hf"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(load_config("configs/smoke_cpu.yaml").model.load_hf_config()).save_pretrained(hf)
    env = {"NPROC": "2", "VENV": sys.prefix}
    for args in (
        ["hf-to-megatron", "--hf", str(hf), "--out", str(tmp_path / "mcore"), "--ep", "2"],
        ["megatron-to-hf", "--megatron", str(tmp_path / "mcore"), "--out", str(tmp_path / "back"), "--ep", "2"],
    ):
        done = slurm.run(
            ["srun", "--nodes=1", "--gpus-per-node=0", "scripts/torchrun_convert.sh", *args],
            cwd=REPO,
            env=env,
            timeout=600,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.count("wrote ") == 1, done.stdout
    original, back = HFCheckpointReader(hf), HFCheckpointReader(tmp_path / "back")
    assert back.names() == original.names()
    for name in original.names():
        assert torch.equal(back.read(name), original.read(name)), name
    _assert_nothing_left(str(tmp_path / "mcore"))


def test_a_local_run_starts_after_the_jobs(slurm, tmp_path):
    """What used to break after a job (`/tmp/ray/ray_current_cluster` left behind): a local run."""
    run = tmp_path / "local"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(
        [str(Path(sys.prefix) / "bin" / "moe-rl"), "train", "configs/demo_cpu.yaml", "steps=2", f"output_dir={run}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(_metrics(run)) == 2
