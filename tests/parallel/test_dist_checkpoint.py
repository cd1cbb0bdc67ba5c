"""`parallel.dist_checkpoint.save_sharded`: megatron-core's checkpoint writer goes with its process."""

import pytest

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)


SAVE_THEN_HANG = """
import os, sys, time
import torch, torch.distributed as dist
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.strategies import filesystem_async
from parallel.dist_checkpoint import save_sharded
from parallel import cpu_compat

cpu_compat.apply()
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1)
save_sharded({"w": ShardedTensor.from_rank_offsets("w", torch.arange(8.0), replica_id=0)}, sys.argv[1])
print(filesystem_async._results_queue._manager._process.pid, flush=True)
time.sleep(600)
"""


def test_a_killed_process_leaves_no_checkpoint_writer_behind(tmp_path):
    """megatron-core's writer starts a Manager process; a SIGKILLed trainer (a Ray actor, a
    cancelled job) never runs the exit handler that stops it, so it must go with its parent."""
    import subprocess
    import sys

    import psutil

    from parallel.world import free_port

    (tmp_path / "ckpt").mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", SAVE_THEN_HANG, str(tmp_path / "ckpt"), str(free_port())],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        manager = psutil.Process(int(proc.stdout.readline()))
        assert (tmp_path / "ckpt" / "metadata.json").exists() or any((tmp_path / "ckpt").iterdir())  # it saved
        proc.kill()
        proc.wait()
        gone, alive = psutil.wait_procs([manager], timeout=30)  # its watch thread looks every second
        assert not alive, f"the checkpoint writer's Manager {manager.pid} outlived its killed parent"
    finally:
        proc.kill()
