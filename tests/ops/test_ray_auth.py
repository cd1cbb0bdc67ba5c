"""`moe-rl train` starts its own Ray with token authentication: Ray's processes listen on every
interface, so a client without the run's token is refused; with it, it joins."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

PROBE = "import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False, logging_level='ERROR'); print('joined')"


def _driver() -> None:
    """A fresh process, as `moe-rl train` runs: protect, then start the local Ray; try two clients."""
    from moe_rl.commands.train import protect_local_ray

    protect_local_ray()
    from moe_rl.rl.ray_init import init_ray

    gcs = init_ray(num_cpus=1, num_gpus=0)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    for label, extra in (
        ("without", {"RAY_AUTH_MODE": "disabled"}),
        ("with", {k: os.environ[k] for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}),
    ):
        probe = subprocess.run(
            [sys.executable, "-c", PROBE, gcs], env={**env, **extra}, capture_output=True, text=True, timeout=120
        )
        print(label, probe.returncode, "joined" in probe.stdout, "InvalidAuthToken" in probe.stderr)


def test_the_local_ray_of_a_run_refuses_clients_without_its_token():
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH") and k != "RAY_ADDRESS"}
    code = "from tests.ops.test_ray_auth import _driver; _driver()"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    lines = {
        line.split()[0]: line.split()[1:] for line in out.stdout.splitlines() if line.startswith(("with", "without"))
    }
    assert lines.get("without", [None])[0] != "0" and lines["without"][2] == "True", out.stdout + out.stderr[-2000:]
    assert lines["with"] == ["0", "True", "False"], out.stdout + out.stderr[-2000:]


def _start_beside_a_stale_cluster(stale_file: str) -> str:
    """A fresh process: /tmp/ray names a cluster that no longer exists (a killed run); start ours."""
    from moe_rl.rl.ray_init import init_ray

    os.makedirs(os.path.dirname(stale_file), exist_ok=True)
    with open(stale_file, "w") as f:
        f.write("127.0.0.1:1\n")
    return init_ray(num_cpus=1, num_gpus=0)


def test_a_stale_cluster_of_a_killed_run_is_never_joined():
    stale = "/tmp/ray/ray_current_cluster"
    backup = open(stale).read() if os.path.exists(stale) else None
    try:
        env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
        env.pop("RAY_ADDRESS", None)
        code = f"from tests.ops.test_ray_auth import _start_beside_a_stale_cluster as s; print(s({stale!r}))"
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert "127.0.0.1:1" not in out.stdout  # a local Ray of its own, not the stale address
    finally:
        if backup is None:
            os.remove(stale)
        else:
            with open(stale, "w") as f:
                f.write(backup)
