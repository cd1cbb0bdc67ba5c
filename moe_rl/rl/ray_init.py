"""Joining Ray: start a private local Ray, or connect to a running cluster when RAY_ADDRESS is set.

`scripts/slurm/train.sbatch` starts a head on the first node and workers on the others, waits
for every node with `python -m moe_rl.rl.ray_init wait --nodes N`, exports RAY_ADDRESS and runs
`moe-rl train`, whose driver then joins that cluster instead of starting one (`init_ray`).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time

import ray

RUNTIME_ENV = {"env_vars": {"OMP_NUM_THREADS": "1"}}  # workers inherit the auth mode of the cluster


def init_ray(num_cpus: int, num_gpus: int) -> str:
    """Connect to RAY_ADDRESS if set (its resources are the cluster's), else start a local Ray with
    `num_cpus` logical CPUs and `num_gpus` GPUs. Returns the GCS address joined."""
    # `moe-rl train` turns token auth on before Ray is imported (commands.train.protect_local_ray);
    # a caller that imported Ray already gets a Ray without auth rather than one that rejects it
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    quiet = dict(log_to_driver=False, logging_level="ERROR", runtime_env=RUNTIME_ENV)
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, **quiet)
    else:  # its own temp dir: never the /tmp/ray of another (or a killed) Ray on this machine
        ray.init(num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False,
                 _temp_dir=tempfile.mkdtemp(prefix="moe-rl-ray-", dir="/tmp"), **quiet)
    return ray.get_runtime_context().gcs_address


def wait_for_nodes(address: str, count: int, timeout_s: float) -> int:
    """Block until `count` nodes of the cluster at `address` are alive; returns how many are."""
    deadline = time.monotonic() + timeout_s
    host, port = address.rsplit(":", 1)
    while True:  # the head may still be starting; ray.init aborts the process when no GCS answers
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no Ray head at {address} within {timeout_s:.0f} s") from None
            time.sleep(2)
    ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    try:
        while True:
            alive = sum(node["Alive"] for node in ray.nodes())
            if alive >= count:
                return alive
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {alive} of {count} Ray nodes registered within {timeout_s:.0f} s: "
                                   "check the worker logs (srun ... ray start) and the head address")
            time.sleep(2)
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_rl.rl.ray_init")
    sub = parser.add_subparsers(dest="command", required=True)
    wait = sub.add_parser("wait", help="wait until N nodes joined the Ray cluster at RAY_ADDRESS")
    wait.add_argument("--nodes", type=int, required=True)
    wait.add_argument("--address", default=os.environ.get("RAY_ADDRESS"))
    wait.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    if not args.address:
        parser.error("--address or RAY_ADDRESS is required")
    print(f"ray: {wait_for_nodes(args.address, args.nodes, args.timeout)} nodes alive at {args.address}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
