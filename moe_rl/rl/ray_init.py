"""Joining Ray: start a private local Ray, or connect to a running cluster when RAY_ADDRESS is set.

`scripts/slurm/train.sbatch` asks `moe-rl ray` (`moe_rl.commands.ray_cluster`) for the node's
address (`node_address`: never a loopback one when the node has another) and for the run's
logical CPUs (`demand`), starts a head on the first node and workers on the others, waits for
every node (`wait_for_nodes`), exports RAY_ADDRESS and runs `moe-rl train`, whose driver then
joins that cluster instead of starting one (`init_ray`).
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import shutil
import signal
import socket
import tempfile
import threading
import time

import psutil
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
    # Ray installs a crash handler in the driver that aborts on SIGTERM; the driver's own handlers
    # (a preemption's checkpoint, `moe_rl.rl.preemption`) are put back after it
    main = threading.current_thread() is threading.main_thread()
    handlers = {sig: signal.getsignal(sig) for sig in _DRIVER_SIGNALS} if main else {}
    if address:
        ray.init(address=address, **quiet)
    else:  # "local" and its own temp dir: never the /tmp/ray of another (or a killed) Ray on this machine
        temp = tempfile.mkdtemp(prefix="moe-rl-ray-", dir="/tmp")
        atexit.register(shutil.rmtree, temp, ignore_errors=True)  # runs after Ray's own shutdown hook
        ray.init(
            address="local", num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False, _temp_dir=temp, **quiet
        )
    for sig, handler in handlers.items():
        if callable(handler):
            signal.signal(sig, handler)
    return ray.get_runtime_context().gcs_address


_DRIVER_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


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
                raise RuntimeError(
                    f"only {alive} of {count} Ray nodes registered within {timeout_s:.0f} s: "
                    "check the worker logs (srun ... ray start) and the head address"
                )
            time.sleep(2)
    finally:
        ray.shutdown()


def node_address() -> tuple[str, str]:
    """This node's IPv4 address for other nodes, and the interface holding it (for
    GLOO_SOCKET_IFNAME, which takes a name, not NCCL's `^lo` exclusions). The address of the
    default route (Ray's choice) unless that is a loopback; then the first non-loopback address;
    loopback only on a node that has nothing else."""
    interfaces = {
        addr.address: name
        for name, addrs in psutil.net_if_addrs().items()
        for addr in addrs
        if addr.family == socket.AF_INET
    }
    chosen = ray.util.get_node_ip_address()
    if chosen not in interfaces or ipaddress.ip_address(chosen).is_loopback:
        routable = [a for a in interfaces if not ipaddress.ip_address(a).is_loopback]
        chosen = routable[0] if routable else "127.0.0.1"
    return chosen, interfaces.get(chosen, "lo")
