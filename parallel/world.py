"""Process worlds: spawn N local gloo ranks, or join the world torchrun/SLURM already made.

The same rank function runs in both cases: `spawn(fn, n)` starts n processes on this machine
(tests, `moe-rl` on a CPU box), each of which calls `init_distributed()`; under torchrun the
environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) is already set and `init_distributed()`
just joins it.
"""

from __future__ import annotations

import os
import pickle
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_PORT" in os.environ


def is_first_process() -> bool:
    """Rank 0 under torchrun, and the one process of a run that spawns its own ranks: where a
    command prints its summary and creates its outputs."""
    return int(os.environ.get("RANK", 0)) == 0


def init_distributed(timeout_s: float = 300) -> tuple[int, int]:
    """Join the default process group from the environment; returns (rank, world_size).

    Backend: NCCL when CUDA is available, gloo otherwise. Every rank must call it.
    """
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    return rank, world_size


def node_names() -> list[str]:
    """Which node each rank of the world runs on: torchrun's node rank (`GROUP_RANK`) where it is
    set, else the host name. Collective over the default group."""
    mine = f"node {os.environ['GROUP_RANK']}" if "GROUP_RANK" in os.environ else socket.gethostname()
    names: list = [None] * dist.get_world_size()
    dist.all_gather_object(names, mine)
    return names


# Imported once by the server that forks spawn()'s ranks (the heavy libraries and this package's model
# code, nothing above it): about 6 CPU seconds a rank saves.
PRELOAD = [
    "torch",
    "transformers",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.optimizer",
    "megatron.core.distributed",
    "parallel.model",
    "parallel.bridges",
]


def spawn(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float | None = 600, fresh: bool = False
) -> list[Any]:
    """Run `fn(*args)` on `world_size` new local processes joined in one gloo world.

    Ranks are forked from a server process that has imported `PRELOAD` already (multiprocessing's
    forkserver), and take this process's environment. Each starts from a bare interpreter
    instead with `fresh=True` (rank functions that must run before megatron-core is imported, or
    environment read at process start, such as glibc's MALLOC_*) and where CUDA is available (a
    server that imported Transformer Engine may hold a CUDA context, which no fork survives).

    Returns each rank's return value (picklable), in rank order. If a rank raises or dies, the
    others are killed and RuntimeError carries that rank's traceback. `timeout_s=None` waits as
    long as the ranks run (training jobs).
    """
    if fresh or torch.cuda.is_available():
        ctx = mp.get_context("spawn")
    else:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)  # read when the server starts (first use)
    results = ctx.SimpleQueue()
    port = free_port()
    threads = max(1, (os.cpu_count() or 1) // world_size)
    environ = dict(os.environ)
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, args, rank, world_size, port, threads, results, environ),
            daemon=False,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    try:
        return _collect(procs, results, world_size, timeout_s)
    except BaseException:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        raise
    finally:
        # Ranks that returned exit on their own: killed instead, they would skip their exit
        # handlers and orphan the processes those stop (megatron-core's checkpoint writer
        # starts a multiprocessing Manager, which its exit handler shuts down).
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)


def _collect(procs, results, world_size: int, timeout_s: float | None) -> list[Any]:
    outputs: dict[int, Any] = {}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while len(outputs) < world_size:
        while not results.empty():
            status, rank, payload = results.get()
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            outputs[rank] = pickle.loads(payload)
        if len(outputs) == world_size:
            break
        dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outputs]
        if dead and results.empty():
            code = procs[dead[0]].exitcode
            raise RuntimeError(f"rank {dead[0]} died with exit code {code} before returning")
        if deadline is not None and time.monotonic() > deadline:
            missing = sorted(set(range(world_size)) - set(outputs))
            raise RuntimeError(f"ranks {missing} did not finish within {timeout_s:.0f} s")
        time.sleep(0.02)
    return [outputs[rank] for rank in range(world_size)]


def _rank_main(fn, args, rank, world_size, port, threads, results, environ) -> None:
    os.environ.clear()  # a forked rank has the server's environment: take the caller's
    os.environ.update(environ)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    # Ranks share the machine's cores: more threads per rank only oversubscribes them.
    torch.set_num_threads(threads)
    try:
        init_distributed()
        output = fn(*args)
        # Plain pickle copies tensor bytes; the queue's own pickler would share them through a
        # file descriptor that vanishes when this rank exits before the parent reads it.
        results.put(("ok", rank, pickle.dumps(output)))
    except BaseException:  # report every failure, including KeyboardInterrupt, to the parent
        results.put(("error", rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
