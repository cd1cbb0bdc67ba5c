"""Disjoint CPU pools: the trainer ranks and each embedded engine pinned to cores of their own.

The CPU picture of disaggregated GPU pools: with `cpu_pools:` set, each trainer rank (a Ray actor)
and each embedded engine process is pinned with `sched_setaffinity` and runs one torch thread per
core it owns, so generation and training stop time-sharing cores and can overlap for real. The
rollout worker runs on the engines' cores (its work, building requests and scoring responses, is
generation's; left free it would steal the trainer's cores), as SCHED_BATCH: woken by each
response an engine sends, it would otherwise take the core from the engine in the middle of
sending the rest (and of answering the weight sync's calls). The driver runs on the trainer's cores
while its `RLCluster` lives, and so do the Ray processes it starts: its work (building the batch,
logging) alternates with the trainer's, which waits for it, while left free it takes time from the
engines, whose core is the busy one in fully_async mode.

`CpuPoolsConfig` is the config section (validated against the cores this process may use);
`pin_process` is what each pinned process calls on itself, first thing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


def available_cores() -> set[int]:
    """The cores this process may run on (cgroup / taskset limits included)."""
    return set(os.sched_getaffinity(0))


@dataclass(kw_only=True)
class CpuPoolsConfig:
    """Which cores the trainer ranks and the embedded engines own (Linux core ids)."""

    trainer: list[int] | list[list[int]]
    """The trainer ranks' cores: one list shared by every rank (each rank then runs
    len(cores) // world_size threads, at least 1), or one list per rank (trainer.world_size lists)."""
    engines: list[list[int]]
    """One list of cores per embedded engine (engines.count lists); an engine runs one thread per core."""
    allow_overlap: bool = False
    """Let pools share cores. Off by default: overlapping pools time-share those cores again,
    which is what pools are meant to rule out, so an overlap is most likely a typo."""

    def __post_init__(self):
        lists = (
            [("cpu_pools.trainer", self.trainer)]
            if self.shared_trainer
            else [(f"cpu_pools.trainer[{i}]", cores) for i, cores in enumerate(self.trainer)]
        )
        lists += [(f"cpu_pools.engines[{i}]", cores) for i, cores in enumerate(self.engines)]
        if not self.trainer or not self.engines:
            raise ValueError(
                "cpu_pools: set cpu_pools.trainer (e.g. [0]) and cpu_pools.engines (e.g. [[1]]), "
                "or leave cpu_pools out (no pinning)"
            )
        have = available_cores()
        for name, cores in lists:
            if not cores:
                raise ValueError(f"{name}=[]: give it at least one core")
            if len(set(cores)) != len(cores):
                raise ValueError(f"{name}={cores}: a core is listed twice; list each core once")
            missing = sorted(set(cores) - have)
            if missing:
                raise ValueError(
                    f"{name}={cores}: cores {missing} are not available here (this process may "
                    f"use {sorted(have)}, `nproc` = {len(have)}); use cores from that set"
                )
        if not self.allow_overlap:
            owner: dict[int, str] = {}
            for name, cores in lists:
                for core in cores:
                    if core in owner:
                        raise ValueError(
                            f"{name} and {owner[core]} both hold core {core}: pools are disjoint "
                            "unless cpu_pools.allow_overlap: true; give each pool its own cores"
                        )
                    owner[core] = name

    @property
    def shared_trainer(self) -> bool:
        """One core list for every trainer rank (else one per rank)."""
        return all(isinstance(core, int) for core in self.trainer)

    def trainer_cores(self, world_size: int) -> list[tuple[list[int], int]]:
        """Per trainer rank: (its cores, its torch threads)."""
        if self.shared_trainer:
            return [(list(self.trainer), max(1, len(self.trainer) // world_size))] * world_size
        return [(list(cores), len(cores)) for cores in self.trainer]

    @property
    def driver_cores(self) -> list[int]:
        """The driver's cores: every trainer rank's."""
        lists = [self.trainer] if self.shared_trainer else self.trainer
        return sorted({core for cores in lists for core in cores})

    @property
    def rollout_cores(self) -> list[int]:
        """The rollout worker's cores: every engine's."""
        return sorted({core for cores in self.engines for core in cores})

    def check(self, world_size: int, engine_count: int, engine_kind: str) -> None:
        """The pools against the run's trainer world and engines (RunConfig calls this)."""
        if not self.shared_trainer and len(self.trainer) != world_size:
            raise ValueError(
                f"cpu_pools.trainer has {len(self.trainer)} lists but trainer.world_size={world_size}: "
                "give one list per rank, or one flat list shared by every rank"
            )
        if len(self.engines) != engine_count:
            raise ValueError(
                f"cpu_pools.engines has {len(self.engines)} lists but engines.count={engine_count}: "
                "give one list of cores per engine"
            )
        if engine_kind != "embedded":
            raise ValueError(
                f"cpu_pools with engines.kind={engine_kind!r}: only embedded (CPU) engines are pinned; "
                "leave cpu_pools out on GPU clusters (the GPUs are the pools there)"
            )


def pin_process(cores: list[int], batch: bool = False) -> list[int]:
    """Pin every thread of this process to `cores` (threads started later inherit it); returns
    the cores the process now has. Every thread, not just the caller: sched_setaffinity(0) pins
    only the calling thread, and a Ray actor runs methods on other threads than its constructor.
    `batch`: SCHED_BATCH as well, so that a thread of this process that wakes up does not take
    the core from the one running there (it waits for its turn)."""
    wanted = set(cores)
    seen: set[int] = set()
    while True:  # a thread may start while we pin; loop until no new one appears
        tids = {int(tid) for tid in os.listdir("/proc/self/task")} - seen
        if not tids:
            break
        for tid in tids:
            try:
                os.sched_setaffinity(tid, wanted)
                if batch:
                    os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
            except ProcessLookupError:  # it exited meanwhile
                pass
            except OSError as error:  # EINVAL: none of the cores exists or is allowed (cgroup cpuset)
                raise ValueError(f"cannot pin to cores {sorted(wanted)}: {error}") from None
        seen |= tids
    got = set(os.sched_getaffinity(0))
    if got != wanted:  # the kernel keeps only the allowed ones
        raise ValueError(
            f"pinned to cores {sorted(wanted)} but the process got {sorted(got)}: "
            "some are outside this process's allowed set (taskset / cgroup cpuset)"
        )
    return sorted(got)


def process_cores(pid: int) -> list[int]:
    """The cores process `pid` may run on (its main thread's `Cpus_allowed_list`)."""
    return sorted(os.sched_getaffinity(pid))
