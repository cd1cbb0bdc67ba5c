"""The Megatron trainer world as Ray actors: one `TrainerRank` per rank, driven in lockstep.

`TrainerGroup` (driver side) creates the actors in a placement group (one bundle per rank: CPUs
here, one GPU each on clusters), lets rank 0 pick the rendezvous (its node address and a free
port), and calls every actor's method at once: each method runs collectives, so every rank must
enter it. Results are rank 0's (the ranks agree). Each actor calls `cpu_compat.apply()` on the
thread that runs Megatron (the CPU patches are per thread for the device-literal mode).

A collective method is declared once: `@collective` on `TrainerRank` (it runs on Megatron's CPU
patches), and `TrainerGroup.name = on_every_rank(TrainerRank.name)` (every rank at once, rank 0's
result), the request objects passing through unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Concatenate, ParamSpec, TypeVar

import ray
import torch
import torch.distributed as dist
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from moe_rl.algorithms import AlgorithmConfig
from moe_rl.cpu_pools import pin_process, process_cores
from moe_rl.gc_freeze import freeze_setup
from moe_rl.rl.consistency_probe import PROBE_TIME, ProbeBatch, compare, skipped_probe
from moe_rl.rl.stacks import RunProcess, enable_stack_dumps
from moe_rl.rollout.train_batch import RLBatch
from moe_rl.trace import TRACER
from moe_rl.trainer.checkpoint import BackgroundCheckpoints, load_checkpoint, save_checkpoint
from moe_rl.trainer.megatron_trainer import MegatronTrainer
from moe_rl.trainer.rl_step import rl_step
from moe_rl.trainer.weight_sync import ConnectRequest, SyncRequest, SyncResult, WeightSync, fp8_format
from parallel import cpu_compat
from parallel.world import free_port, init_distributed

P = ParamSpec("P")
R = TypeVar("R")


def collective(method: Callable[Concatenate[Any, P], R]) -> Callable[Concatenate[Any, P], R]:
    """A `TrainerRank` method that runs collectives: every rank enters it at once (through
    `on_every_rank`), with Megatron's CPU patches applied on the calling thread (idempotent; Ray
    may run a method on another thread)."""

    @functools.wraps(method)
    def on_this_rank(self, *args: P.args, **kwargs: P.kwargs) -> R:
        if not torch.cuda.is_available():
            cpu_compat.apply()
        self.call = (method.__name__, time.monotonic())
        try:
            return method(self, *args, **kwargs)
        finally:
            self.call = None

    return on_this_rank


def on_every_rank(method: Callable[Concatenate[Any, P], R]) -> Callable[Concatenate[Any, P], R]:
    """`TrainerGroup`'s side of a `@collective` `TrainerRank` method: the same call on every rank
    at once, rank 0's result (the ranks agree)."""

    @functools.wraps(method)
    def fan_out(group: TrainerGroup, *args: P.args, **kwargs: P.kwargs) -> R:
        return group._all(method, *args, **kwargs)

    return fan_out


@dataclass(frozen=True)
class SaveHFRequest:
    """`TrainerRank.save_hf`: the policy's weights as an HF checkpoint."""

    out_dir: str
    """Where the checkpoint is written (staged, renamed when complete)."""
    merged: bool = True
    """With LoRA: True = base + adapters merged (engines without LoRA), False = the frozen base
    alone (what adapter engines serve). Without LoRA: the weights either way."""
    fp8_blocks: int | None = None
    """Decoder linear weights as FP8 blocks of this size (engines that serve FP8); None: as trained."""


class TrainerFault(RuntimeError):
    """A trainer rank died or missed the call deadline (`rl.call_timeout_s`); the message names
    the ranks and the call. The driver restarts the trainer from the newest run checkpoint
    (`rl.max_restarts`) or ends the run with it."""


class TrainerRank:
    """One rank of the trainer world (a Ray actor). `cpus`: pin the rank's process to these cores
    (`cpu_pools.trainer`) first, before torch starts its thread pool. `status` runs on a thread
    of its own ("status" concurrency group), so it answers while a collective call is stuck."""

    def __init__(self, rank: int, world_size: int, threads: int, cpus: list[int] | None = None):
        self.rank, self.world_size = rank, world_size
        TRACER.process = f"trainer rank {rank}"
        if cpus:
            pin_process(cpus)
        torch.set_num_threads(threads)
        self.trainer = self.weight_sync = None
        self.call: tuple[str, float] | None = None  # the collective call under way and its start

    @ray.method(concurrency_group="status")
    def status(self) -> tuple[str, float] | None:
        """(the collective call under way, its seconds so far), or None: what a missed deadline reports."""
        call = self.call
        return call and (call[0], time.monotonic() - call[1])

    def cpus(self) -> dict:
        """The cores this rank's process may run on and its torch threads (what the pools gave it)."""
        return {"cores": process_cores(os.getpid()), "threads": torch.get_num_threads()}

    def device(self) -> tuple[str, list[str]]:
        """(node address, the GPU ids Ray gave this rank): where colocated engines may run."""
        return ray.util.get_node_ip_address(), [str(gpu) for gpu in ray.get_gpu_ids()]

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0: the address and a free port for the gloo/NCCL world."""
        return ray.util.get_node_ip_address(), free_port()

    @collective
    def setup(self, master: tuple[str, int], trainer_config, model_config, lora=None) -> None:
        """Join the world and build this rank's model, DDP and optimizer (collective)."""
        os.environ.update(
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK="0",
            MASTER_ADDR=master[0],
            MASTER_PORT=str(master[1]),
        )
        init_distributed()
        self.hf_config = model_config.load_hf_config()
        self.model_path = model_config.path
        self.trainer = MegatronTrainer(trainer_config, self.hf_config, lora=lora)
        if model_config.path is not None:
            self.trainer.load_hf_weights(model_config.path)
        self.weight_sync = WeightSync(self.trainer, self.rank, self.world_size)
        self.checkpoints = BackgroundCheckpoints()
        freeze_setup()  # the model's and megatron-core's objects: out of the collector's full passes

    @collective
    def save_hf(self, request: SaveHFRequest) -> None:
        """The weights as an HF checkpoint (`SaveHFRequest` says which and how; collective)."""
        self.trainer.save_hf_checkpoint(
            request.out_dir, self.hf_config.to_dict(), merged=request.merged, fp8=fp8_format(request.fp8_blocks)
        )

    @collective
    def save_adapter(self, out_dir: str) -> None:
        """LoRA: the adapters as a PEFT directory (collective)."""
        self.trainer.save_adapter(out_dir, self.model_path)

    @collective
    def save_checkpoint(self, directory: str, background: bool = False) -> None:
        """Megatron dist checkpoint: model, optimizer, RNG, step (collective, atomic);
        `background`: the tensors are written while training goes on, `finish_checkpoints`
        completes it."""
        with TRACER.span("checkpoint"):
            if background:
                self.checkpoints.save(self.trainer, directory)
            else:
                save_checkpoint(self.trainer, directory)

    @collective
    def finish_checkpoints(self, blocking: bool) -> list[str]:
        """Complete the background checkpoints written on every rank (`blocking`: wait for all);
        their directories (collective)."""
        with TRACER.span("checkpoint finish"):
            return self.checkpoints.finish(blocking)

    @collective
    def load_checkpoint(self, directory: str) -> int:
        """Load a dist checkpoint into the built trainer (collective); returns its optimizer step."""
        load_checkpoint(self.trainer, directory)
        return self.trainer.step

    @collective
    def connect(self, request: ConnectRequest) -> None:
        """`WeightSync.connect` on this rank (collective)."""
        self.weight_sync.connect(request)

    @collective
    def sync_weights(self, request: SyncRequest) -> SyncResult:
        """`WeightSync.sync` on this rank (collective)."""
        return self.weight_sync.sync(request)

    @collective
    def step(
        self,
        batch: list[ray.ObjectRef],
        algorithm: AlgorithmConfig,
        step: int,
        probe: list[ray.ObjectRef] | None = None,
    ) -> dict[str, float]:
        """`moe_rl.trainer.rl_step.rl_step` of RL `step` on this rank (collective). `batch`: the
        rollout worker's ObjectRef of the `RLBatch`, in a list so that Ray passes the ref and this
        rank fetches the tensors itself (the timeline's "batch transfer"). `probe`: the previous
        step's consistency probe, the engines' scoring as an ObjectRef in a list, compared before
        this step's first optimizer step (its metrics come back beside the step's)."""
        with TRACER.span("batch transfer"):
            tensors = ray.get(batch[0])
        probed: dict[str, float] = {}
        before_update = (lambda: probed.update(self._probe(probe[0]))) if probe else None
        with TRACER.span("train step", step=step):
            metrics = rl_step(self.trainer, tensors, algorithm, self.model_path, step=step, before_update=before_update)
        if probed:  # the probe ran inside the train step's time: not the step's own
            metrics["time/train_step_s"] -= probed[PROBE_TIME]
        return {**metrics, **probed}

    @collective
    def probe(self, scored: list[ray.ObjectRef]) -> dict[str, float]:
        """The consistency probe on this rank's weights now (collective): `scored` holds the
        rollout worker's scoring (`RolloutWorker.score_probe`) as an ObjectRef in a list."""
        return self._probe(scored[0])

    def _probe(self, scored: ray.ObjectRef) -> dict[str, float]:
        """`compare` against the engines' scores once they are in, or the skip they answered
        (the driver logs why); `time/consistency_probe_s` is what it cost this rank."""
        start = time.perf_counter()
        with TRACER.span("consistency probe"):
            answer: ProbeBatch | str = ray.get(scored)
            metrics = skipped_probe() if isinstance(answer, str) else compare(self.trainer, answer)
        metrics[PROBE_TIME] = time.perf_counter() - start
        return metrics

    def enable_stack_dumps(self, run_dir: str) -> RunProcess:
        """SIGUSR2 dumps this rank's stacks (`moe_rl.rl.stacks`)."""
        return enable_stack_dumps(run_dir, TRACER.process)

    def start_trace(self) -> None:
        """Record this rank's spans (`moe_rl.trace`)."""
        TRACER.start()

    def stop_trace(self) -> dict:
        """Stop recording; this rank's spans."""
        return TRACER.stop()

    def close(self) -> None:
        if self.weight_sync is not None:
            self.weight_sync.close()

        if dist.is_initialized():
            dist.destroy_process_group()


class TrainerGroup:
    """Driver side: the trainer world's actors, every call issued to all ranks at once."""

    def __init__(
        self,
        world_size: int,
        trainer_config,
        model_config,
        *,
        use_gpus: bool,
        lora=None,
        cpu_pools=None,
        call_timeout_s: float = 1800.0,
    ):
        self.call_timeout_s = call_timeout_s
        self.faulted = False  # a rank died or missed a deadline: close() only kills the actors
        bundle = {"GPU": 1, "CPU": 1} if use_gpus else {"CPU": 1}
        self.placement = placement_group([bundle] * world_size, strategy="PACK")
        ray.get(self.placement.ready())
        if cpu_pools is not None:  # moe_rl.cpu_pools.CpuPoolsConfig: each rank's cores and threads
            cores = cpu_pools.trainer_cores(world_size)
        else:  # unpinned: half the machine's cores for the trainer (the engines time-share the rest)
            cores = [(None, max(1, (os.cpu_count() or 1) // (2 * world_size)))] * world_size
        actor = ray.remote(concurrency_groups={"status": 1})(TrainerRank)
        self.actors = [
            actor.options(
                num_cpus=1,
                num_gpus=1 if use_gpus else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement, i),
            ).remote(i, world_size, threads, cpus)
            for i, (cpus, threads) in enumerate(cores)
        ]
        master = ray.get(self.actors[0].rendezvous.remote())
        self._all(TrainerRank.setup, master, trainer_config, model_config, lora)

    # -- the ranks' methods, each run on every rank at once (see TrainerRank for what they do) --
    def start_step(
        self,
        batch: ray.ObjectRef | RLBatch,
        algorithm: AlgorithmConfig,
        step: int,
        probe: ray.ObjectRef | None = None,
    ) -> list:
        """Start RL `step` on every rank; returns at once (`step_result` waits). `batch`: the rollout
        worker's ObjectRef (each rank fetches it; the tensors never pass through the driver) or an
        `RLBatch` (put once here). `probe`: the rollout worker's scoring of the previous step's
        consistency probe, compared before this step's update (`TrainerRank.step`)."""
        ref = ray.put(batch) if isinstance(batch, RLBatch) else batch
        return self._submit(TrainerRank.step, [ref], algorithm, step, [probe] if probe is not None else None)

    def step_result(self, refs: list) -> dict[str, float]:
        """Rank 0's metrics of the step `start_step` started."""
        return self._collect(TrainerRank.step.__name__, refs)[0]

    sync_weights = on_every_rank(TrainerRank.sync_weights)
    connect = on_every_rank(TrainerRank.connect)
    probe = on_every_rank(TrainerRank.probe)
    save_hf = on_every_rank(TrainerRank.save_hf)
    save_adapter = on_every_rank(TrainerRank.save_adapter)
    save_checkpoint = on_every_rank(TrainerRank.save_checkpoint)
    finish_checkpoints = on_every_rank(TrainerRank.finish_checkpoints)
    load_checkpoint = on_every_rank(TrainerRank.load_checkpoint)

    def start_trace(self) -> None:
        """Every rank records its spans (`moe_rl.trace`)."""
        self._each(TrainerRank.start_trace)

    def stop_trace(self) -> list[dict]:
        """Every rank's spans, in rank order."""
        return self._each(TrainerRank.stop_trace)

    def enable_stack_dumps(self, run_dir: str) -> list[RunProcess]:
        """SIGUSR2 dumps each rank's stacks into `run_dir` (`moe_rl.rl.stacks`); the ranks' processes."""
        return self._each(TrainerRank.enable_stack_dumps, run_dir)

    def cpus(self) -> list[dict]:
        """Every rank's cores and threads, in rank order."""
        return self._each(TrainerRank.cpus)

    def devices(self) -> list[tuple[str, list[str]]]:
        """Every rank's (node address, GPU ids), in rank order."""
        return self._each(TrainerRank.device)

    def _all(self, method, *args: Any, **kwargs: Any) -> Any:
        """`TrainerRank.method(*args, **kwargs)` on every rank (a collective); rank 0's result."""
        return self._each(method, *args, **kwargs)[0]

    def _each(self, method, *args: Any, **kwargs: Any) -> list:
        """Every rank's result of `method`."""
        return self._collect(method.__name__, self._submit(method, *args, **kwargs))

    def _submit(self, method, *args: Any, **kwargs: Any) -> list:
        """`TrainerRank.method(*args, **kwargs)` started on every rank; their refs, in rank order."""
        return [getattr(actor, method.__name__).remote(*args, **kwargs) for actor in self.actors]

    def _collect(self, call: str, refs: list) -> list:
        """Every rank's result of the call `refs` started; `TrainerFault` when a rank died or the
        ranks did not all answer within `call_timeout_s` (a Python error in a rank is raised as it is)."""
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        pending, deadline = refs, time.monotonic() + self.call_timeout_s
        try:
            while pending:
                done, pending = ray.wait(pending, timeout=max(0.0, deadline - time.monotonic()))
                if not done:
                    raise TrainerFault(self._missed(call, sorted(rank_of[ref] for ref in pending)))
                for ref in done:
                    try:
                        _raise_if_died(ref, rank_of[ref], call)
                    except RayTaskError as error:
                        # a rank whose peer died or hangs fails its collective first (closed
                        # connection, collective timeout): name that peer; else the error is the call's
                        self._raise_peer_fault(call, rank_of[ref], error, pending, rank_of)
                        raise
        except TrainerFault:
            self.faulted = True
            raise
        return ray.get(refs)

    def _raise_peer_fault(self, call: str, rank: int, error: RayTaskError, pending: list, rank_of: dict) -> None:
        done, late = ray.wait(pending, num_returns=len(pending), timeout=_SETTLE_S)
        for ref in done:
            with contextlib.suppress(RayTaskError):  # its own failure of the collective
                _raise_if_died(ref, rank_of[ref], call)
        if late:
            first_line = str(error.cause).splitlines()[0] if str(error.cause) else type(error.cause).__name__
            raise TrainerFault(
                f"trainer call `{call}`: rank {rank} failed ({first_line}) while ranks "
                f"{sorted(rank_of[ref] for ref in late)} did not answer"
            ) from None

    def _missed(self, call: str, ranks: list[int]) -> str:
        """Who missed the deadline of `call` and where they are: each rank's call under way, or
        that it does not answer at all (its process stopped, or wedged without releasing the GIL)."""
        statuses = [actor.status.remote() for actor in self.actors]
        ray.wait(statuses, num_returns=len(statuses), timeout=_SETTLE_S)
        where = []
        for rank in ranks:
            try:
                status = ray.get(statuses[rank], timeout=0)
                where.append(f"rank {rank} in `{status[0]}` for {status[1]:.0f} s" if status else f"rank {rank} idle")
            except (GetTimeoutError, RayActorError):
                where.append(f"rank {rank} does not answer")
        return (
            f"trainer call `{call}`: ranks {ranks} did not answer within rl.call_timeout_s={self.call_timeout_s:g} s "
            f"({'; '.join(where)})"
        )

    def close(self) -> None:
        try:
            if not self.faulted:  # a dead or stuck rank would not enter the collective close
                self._all(TrainerRank.close)
        finally:
            for actor in self.actors:
                ray.kill(actor)
            ray.util.remove_placement_group(self.placement)


def _raise_if_died(ref: ray.ObjectRef, rank: int, call: str) -> None:
    """`ray.get(ref)` of rank `rank`'s `call`: `TrainerFault` when the rank's actor died; a Python
    error in the rank is raised as it is (`RayTaskError`)."""
    try:
        ray.get(ref)
    except RayActorError:
        raise TrainerFault(f"trainer rank {rank} died during `{call}`") from None


_SETTLE_S = 10.0
"""How long a failed or late call waits for the other ranks' answers: a dead peer's death, or
each rank's `status`, arrives within it."""
