"""Saving Megatron dist checkpoints (torch_dist) from processes that may be killed.

`save_sharded` is `dist_checkpointing.save` (collective: every rank of the model's world calls it
with its own sharded state) whose writer's results queue is served by a Manager that exits with
this process: the trainer's checkpoints (`moe_rl.trainer.checkpoint`) and `moe-rl convert`
(`moe_rl.conversion.ranks`) both save through it.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from inspect import signature
from multiprocessing.managers import SyncManager
from pathlib import Path


def save_sharded(state: dict, directory: str | Path, asynchronous: bool = False):
    """`dist_checkpointing.save` (collective), with the writer's results queue served by a Manager
    that exits with this process. megatron-core starts that Manager once per process and stops it
    in an exit handler, which a killed process (a Ray actor, a cancelled job) never runs: its
    Manager would outlive it. Ours watches its parent and exits within a second of it.
    `asynchronous`: returns megatron-core's `AsyncRequest` (the tensors' writing, for an
    `AsyncCallsQueue`) instead of writing them here; None otherwise."""
    # heavy: megatron-core, loaded only where a model is built (after parallel.cpu_compat.apply)
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
        manager.start(_exit_with_parent, (os.getpid(),))
        filesystem_async._results_queue = manager.Queue()  # the proxy keeps the Manager alive
    # megatron-core >= 0.19 writes asynchronously through nvidia-resiliency-ext by default
    # (`async_strategy="nvrx"`), an optional package: its own writer, as 0.16 has it
    writer = {"async_strategy": "mcore"} if "async_strategy" in signature(dist_checkpointing.save).parameters else {}
    return dist_checkpointing.save(state, str(directory), async_sharded_save=asynchronous, **writer)


def _exit_with_parent(parent: int) -> None:
    """Manager initializer: a daemon thread ends the Manager once `parent` is gone (reparented)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()
