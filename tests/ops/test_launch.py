"""Launch scripts parse, and the RL driver joins an existing Ray cluster through RAY_ADDRESS."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import ray

from moe_rl.rl.ray_init import init_ray

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

SCRIPTS = sorted(Path("scripts").glob("*.sh")) + [Path("scripts/slurm/train.sbatch")]


@pytest.mark.parametrize("script", SCRIPTS, ids=str)
def test_script_is_valid_bash(script):
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0


def test_sbatch_waits_for_every_node_before_training():
    text = Path("scripts/slurm/train.sbatch").read_text()
    wait = text.index('moe-rl ray wait --nodes "$NNODES"')
    assert text.index('--address="$RAY_ADDRESS"') < wait < text.rindex("moe-rl train")
    for var in ("NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "NCCL_DEBUG"):
        assert var in text


@pytest.fixture(scope="module")
def ray_head():
    """A real Ray head with 1 CPU and a custom resource, started (and stopped) by this test only."""
    port = 20000 + os.getpid() % 20000
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's unix socket paths must fit 107 bytes
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    ray_bin = str(Path(sys.executable).parent / "ray")
    head = subprocess.Popen(
        [
            ray_bin,
            "start",
            "--head",
            f"--port={port}",
            "--num-cpus=1",
            "--num-gpus=0",
            '--resources={"ops_test_head": 1}',
            "--include-dashboard=false",
            "--block",
            f"--temp-dir={temp}",
        ],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    address = f"{ray.util.get_node_ip_address()}:{port}"  # the GCS listens on the node's IP
    try:
        yield address
    finally:
        head.terminate()  # `ray start --block` stops its own daemons
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)


def test_driver_joins_the_cluster_at_ray_address(ray_head, monkeypatch):
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    waited = subprocess.run(
        [sys.executable, "-m", "moe_rl.cli", "ray", "wait", "--nodes", "1", "--address", ray_head, "--timeout", "60"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert waited.returncode == 0, waited.stderr
    assert "1 nodes alive" in waited.stdout
    short = subprocess.run(
        [sys.executable, "-m", "moe_rl.cli", "ray", "wait", "--nodes", "2", "--address", ray_head, "--timeout", "3"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert short.returncode != 0 and "only 1 of 2 Ray nodes registered" in short.stderr

    monkeypatch.setenv("RAY_ADDRESS", ray_head)
    try:
        gcs = init_ray(num_cpus=7, num_gpus=0)  # local sizes are ignored when joining
        assert gcs.endswith(ray_head.split(":")[1])
        resources = ray.cluster_resources()
        assert resources["CPU"] == 1 and resources["ops_test_head"] == 1
    finally:
        ray.shutdown()


def test_a_run_the_cluster_cannot_hold_fails_fast_with_the_numbers(ray_head, monkeypatch, tmp_path):
    """The 1-CPU head holds none of the demo's 4 actors: an error naming both sides, not a run
    pending forever on Ray's "Pending Demands"."""
    from moe_rl.config import load_config
    from moe_rl.rl.cluster import RLCluster

    monkeypatch.setenv("RAY_ADDRESS", ray_head)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    with pytest.raises(RuntimeError, match=r"has 1 CPUs and 0 GPUs .*this run needs 4 CPUs and 0 GPUs"):
        RLCluster(load_config("configs/demo_cpu.yaml"), tmp_path)
    assert not ray.is_initialized()  # the driver let go of the cluster


def test_node_address_is_routable_when_the_node_has_such_an_address():
    import psutil

    from moe_rl.rl.ray_init import node_address

    address, interface = node_address()
    mine = {
        a.address: name for name, addrs in psutil.net_if_addrs().items() for a in addrs if a.family == socket.AF_INET
    }
    assert mine[address] == interface
    if any(not a.startswith("127.") for a in mine):
        assert not address.startswith("127."), address  # `hostname --ip-address` may answer 127.0.1.1


def test_progress_in_a_log_file_is_plain_lines(capsys):
    """Under sbatch stdout is a file: a line every ~5% of the steps and at the last, not a live bar."""
    from moe_rl.progress import StepProgress

    with StepProgress("rl", 45) as progress:
        for step in range(45):
            progress.advance(f"reward {step}")
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[2] for line in lines] == [f"{n}/45" for n in range(2, 45, 2)] + ["45/45"]
    assert lines[-1].startswith("rl step 45/45 (") and lines[-1].endswith("reward 44")
    with StepProgress("train", 3, enabled=False) as progress:  # the non-logging ranks
        progress.advance("loss 1")
    assert capsys.readouterr().out == ""
