"""`RLCluster`: every process of an RL run, placed and owned by Ray.

Start-up, in order:
  1. `init_ray`: a local Ray with this machine's CPUs (GPUs), or the cluster at RAY_ADDRESS;
  2. the trainer world (`TrainerGroup`: a placement group, one actor per rank, rank 0's
     rendezvous) builds the policy (random init, or loaded from `model.path`);
  3. the trainer writes version 0 as an HF checkpoint (`initial_hf/`), so engines and trainer
     start from identical weights (on resume: loads the run checkpoint first and writes version N,
     which the engines announce as their weight version);
  4. `engines.count` `EngineServer` actors each start an engine server on that checkpoint
     (`engine_placement`: embedded = a CPU each; SGLang = `engines.tp` GPUs each, or, with
     `rl.colocate`, the GPUs of trainer ranks [i*tp, (i+1)*tp) inside their bundle); with
     `cpu_pools`, trainer ranks, embedded engines and the rollout worker are pinned to their cores
     (`moe_rl.cpu_pools`; the driver, pinned first, and the Ray it starts share the trainer's) and
     `cpu_pools.json` records the cores each reports;
  5. the trainer's sync source joins the engines' weight-update group (`WeightSender`);
  6. the served models (`algorithm.distill`'s teachers, `rollout.judge`) given by `path` start as
     `ServedModel` actors on the engines' kind (placed like one more engine each, not pinned;
     those given by `url` are only checked);
  7. the `RolloutWorker` actor starts generating (and scoring with the teachers and the judge).
`close()` undoes them in reverse and returns the rollout ledger.

Engine faults (the driver's side; the trainer is never stopped): an engine found dead, by the
rollout pool (its requests failed and `/health` does not answer; the pool has already resubmitted
them elsewhere) or by the weight sender (it could not resume after a sync; the sync was retried on
the live engines), is restarted by its `EngineServer` in the background (`engines/restarts`).
Once its process is healthy it gets the committed version, from a live engine (`moe_rl.rl.joins`:
the trainer keeps stepping) or from the trainer's sender (`sync_weights` catch-up: a weight-update
group of the restarted engines only, the live ones keep generating), and only then does the pool
give it work again. `recover()` does this
bookkeeping; the driver calls it while it waits for a batch and after each sync.

Elastic engines: `recover()` also serves `moe-rl engines add/remove/list` (`moe_rl.rl.fleet`,
through the run directory's control channel `moe_rl.rl.control`): new engines start on the run's
starting checkpoint and are caught up as restarted ones are; a removed one's requests continue on
the others. A local Ray keeps `_LOCAL_SPARE_CPUS` logical CPUs for such engines.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from moe_rl.algorithms.config import ServedConfig
from moe_rl.config import RunConfig
from moe_rl.cpu_pools import pin_process, process_cores
from moe_rl.engine.client import engine_index, engine_name
from moe_rl.plan.launch import sglang_lora_slots
from moe_rl.rl.consistency_probe import ProbeBatch, ProbeRequest
from moe_rl.rl.fleet import EngineFleet
from moe_rl.rl.joins import Joins
from moe_rl.rl.ray_init import init_ray
from moe_rl.rl.resume import RunCheckpoint
from moe_rl.rl.rollout_actor import BatchRequest, EngineServer, RolloutWorker, TrainBatch, engine_placement
from moe_rl.rl.trainer_group import SaveHFRequest, TrainerGroup
from moe_rl.signals.served import ServedModel
from moe_rl.trace import TRACER
from moe_rl.trainer.weight_sync import ConnectRequest, SyncRequest
from parallel.bridges import bridge_for
from sync.config import AdapterSyncConfig
from sync.stages import stage_config


@dataclass(frozen=True)
class RayDemand:
    """The Ray resources an RL run's actors ask for, all at once."""

    cpus: int
    gpus: int
    largest_gpu_ask: int  # GPUs one actor needs on a single node


def ray_demand(config: RunConfig, use_gpus: bool) -> RayDemand:
    """What `RLCluster` will place: one bundle per trainer rank (a GPU each on GPUs), each engine
    server (`engine_placement`; colocated ones hold nothing), each served model it starts (a
    teacher, a judge: an engine of its own) and the rollout worker (1 CPU)."""
    world = config.trainer.world_size
    engines = [
        options for options, _ in engine_placement(config.engines, config.rl.colocate, [("node", ["0"])] * world)
    ]
    trainer_gpus = world if use_gpus else 0
    started = [served for served in served_models(config).values() if served.path]
    engines += [engine_placement(config.engines, colocate=False)[0][0]] * len(started)
    engine_gpus = [options["num_gpus"] if use_gpus else 0 for options in engines]
    return RayDemand(
        cpus=world + sum(options["num_cpus"] for options in engines) + 1,
        gpus=trainer_gpus + sum(engine_gpus),
        largest_gpu_ask=max([1 if trainer_gpus else 0, *engine_gpus]),
    )


def require_resources(demand: RayDemand) -> None:
    """Fail now, with the numbers, when the Ray cluster can never hold the run; Ray itself would
    leave the actors pending forever ("Pending Demands")."""
    total = ray.cluster_resources()
    cpus, gpus = int(total.get("CPU", 0)), int(total.get("GPU", 0))
    node_gpus = max([int(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n["Alive"]] or [0])
    if cpus < demand.cpus or gpus < demand.gpus or node_gpus < demand.largest_gpu_ask:
        raise RuntimeError(
            f"the Ray cluster at {ray.get_runtime_context().gcs_address} has {cpus} CPUs and {gpus} GPUs "
            f"(at most {node_gpus} on one node); this run needs {demand.cpus} CPUs and {demand.gpus} GPUs, "
            f"{demand.largest_gpu_ask} on one node: start Ray with more --num-cpus / --num-gpus "
            "(scripts/slurm/train.sbatch gives the head max(SLURM_CPUS_ON_NODE, the run's CPUs)), or shrink "
            "trainer.world_size / engines.count / engines.tp"
        )


JUDGE = "judge"
"""`served_models`' key of the judge (teachers are keyed by task name, None for the default)."""


def served_models(config: RunConfig) -> dict[str | None, ServedConfig]:
    """The models a run serves beside the policy: distillation teachers by task name, the judge."""
    served = dict(config.algorithm.distill.served()) if config.algorithm.distill else {}
    if config.rollout is not None and config.rollout.judge is not None:
        served[JUDGE] = config.rollout.judge.served
    return served


class RLCluster:
    def __init__(
        self,
        config: RunConfig,
        run_dir: Path,
        restore: RunCheckpoint | None = None,
        kept: list[ray.actor.ActorHandle] | None = None,
    ):
        """`kept`: engine servers of the run's last start, kept running through a trainer fault
        (`detach_engines`); the restarted trainer sends them its version instead of new ones starting."""
        self.config, self.run_dir, self.restore, self.kept = config, run_dir, restore, bool(kept)
        self.trainer = self.rollout = self.fleet = self.joins = None
        self.served: list[ray.actor.ActorHandle] = []  # `ServedModel` actors this run started
        self.detached = False  # `detach_engines` took the engines: `close` leaves them and Ray
        # engine index -> its EngineServer (removed: gone); kept ones numbered 0..n-1 again (the new
        # rollout worker and sender name engines by position)
        self.servers: dict[int, ray.actor.ActorHandle] = dict(enumerate(kept or []))
        self.initial_dir = ""  # the checkpoint engines start on (`initial_hf/`, or the resumed version's)
        self.version = self.initial_version = 0  # committed on the engines / served after a restart
        self.restarting: dict[int, ray.ObjectRef] = {}  # engine index -> its restart's URL
        self.restarts = 0
        self.lost: list[str] = []  # found dead by the pool, not yet removed from the weight sender
        self.cores_before_pinning = sorted(os.sched_getaffinity(0))  # the driver's, restored by close()
        if config.cpu_pools is not None:  # before Ray starts: its processes inherit the driver's cores
            pin_process(config.cpu_pools.driver_cores)
        use_gpus = torch.cuda.is_available()
        demand = ray_demand(config, use_gpus)
        if not ray.is_initialized():
            # Local: the logical CPUs the actors ask for (they time-share cores). With RAY_ADDRESS set
            # (SLURM), the running cluster's resources are used.
            init_ray(num_cpus=demand.cpus + _LOCAL_SPARE_CPUS, num_gpus=torch.cuda.device_count() if use_gpus else 0)
        try:
            require_resources(demand)
            self._start(use_gpus)
        except BaseException:
            self.close()
            raise

    def _start(self, use_gpus: bool) -> None:
        cfg = self.config
        self.trainer = TrainerGroup(
            cfg.trainer.world_size,
            cfg.trainer,
            cfg.model,
            use_gpus=use_gpus,
            lora=cfg.lora,
            cpu_pools=cfg.cpu_pools,
            call_timeout_s=cfg.rl.call_timeout_s,
        )
        version = 0
        if self.restore is not None:  # resume: the engines start on the checkpoint's weights
            self.trainer.load_checkpoint(self.restore.trainer_dir)
            # the run's version, not the trainer's optimizer steps (PPO mini-batches take several)
            version = self.restore.weight_version
        self.initial_dir = str(self.run_dir / ("initial_hf" if version == 0 else f"resumed_hf_v{version}"))
        # LoRA: the engines serve the frozen base and adapter `policy-v{version}` on top of it
        self.trainer.save_hf(SaveHFRequest(self.initial_dir, merged=cfg.lora is None, fp8_blocks=cfg.sync.fp8_blocks))
        self.version = self.initial_version = version
        if self.kept:
            self._adopt_engines()
        else:
            self._start_engines()
        served = self._start_served()
        urls = ray.get([engine.url.remote() for engine in self.engines])
        connect = ConnectRequest(tuple(urls), cfg.sync, cfg.engines.kind, version, self._adapter_sync(), kept=self.kept)
        self.trainer.connect(connect)
        hf = cfg.model.load_hf_config()
        bridge = bridge_for(hf)
        worker = ray.remote(RolloutWorker).options(num_cpus=1, max_concurrency=16)
        self.rollout = worker.remote(
            cfg.effective_rollout(),
            urls,
            cfg.engines.kind,
            hf.num_hidden_layers,
            hf.num_experts_per_tok,
            cfg.lora is not None,
            cfg.cpu_pools.rollout_cores if cfg.cpu_pools else None,
            cfg.model.tokenizer_dir,
            cfg.eval,
            num_experts=bridge.num_experts,
            moe_layers=tuple(bridge.moe_layers),
            teacher_urls={task: url for task, url in served.items() if task != JUDGE} or None,
            judge_url=served.get(JUDGE),
        )
        ray.get(self.rollout.start.remote(self.restore))
        if cfg.cpu_pools is not None:
            self._record_cores()
        self.joins = Joins(self, from_peer=cfg.engines.joins_from_peer and cfg.lora is None)
        self.fleet = EngineFleet(self)  # from here `moe-rl engines` gets answers

    def _start_served(self) -> dict[str | None, str]:
        """The run's served models (`served_models`) -> URL: those given by `path` started as
        `ServedModel` actors (at once, beside the engines' start-up), `url` ones checked for /health."""
        cfg = self.config
        options, _ = engine_placement(cfg.engines, colocate=False)[0]
        urls: dict[str | None, str | ray.ObjectRef] = {}
        for key, served in served_models(cfg).items():
            if served.url is not None:
                urls[key] = ServedModel(served, cfg.engines).url()
                continue
            name = JUDGE if key == JUDGE else "teacher" if key is None else f"teacher-{key}"
            log = str(self.run_dir / f"{name}.log")
            self.served.append(ray.remote(ServedModel).options(**options).remote(served, cfg.engines, log))
            urls[key] = self.served[-1].url.remote()
        return {key: url if isinstance(url, str) else ray.get(url) for key, url in urls.items()}

    @property
    def engines(self) -> list[ray.actor.ActorHandle]:
        """The `EngineServer` actors of the engines in the run now, in index order."""
        return [self.servers[index] for index in sorted(self.servers)]

    def _record_cores(self) -> None:
        """`cpu_pools.json` in the run directory: the cores each pinned process reports it runs on
        (read back from the processes, not copied from the config)."""
        engines = [process_cores(pid) for pid in ray.get([engine.pid.remote() for engine in self.engines])]
        cores = {
            "trainer_ranks": self.trainer.cpus(),
            "engines": engines,
            "rollout_worker": ray.get(self.rollout.cpus.remote()),
        }
        (self.run_dir / "cpu_pools.json").write_text(json.dumps(cores, indent=2))

    def _adapter_sync(self):
        """With LoRA, how adapters reach the engines (sync.lora); None without."""
        cfg = self.config
        if cfg.lora is None:
            return None
        return AdapterSyncConfig(
            route=cfg.sync.lora_route,
            directory=cfg.sync.disk_dir or str(self.run_dir / "adapters"),
            keep=cfg.effective_rollout().max_staleness + 1,
            timeout_s=cfg.sync.timeout_s,
        )

    def ask_batch(self, request: BatchRequest) -> ray.ObjectRef:
        """Ask the rollout worker for a batch (`RolloutWorker.get_batch`); returns at once, the
        worker builds it when its groups are complete. `get_batch` waits for the answer."""
        return self.rollout.get_batch.remote(request)

    def get_batch(self, asked: ray.ObjectRef) -> TrainBatch:
        """The batch `ask_batch` asked for (its tensors by ObjectRef, `moe_rl.rl.rollout_actor`);
        recovers engines while waiting for it."""
        return self._wait(asked)

    def engines_active_s(self) -> float:
        """The mean engine's active seconds so far (the rollout worker's `engines/active_s`), read
        without taking the counters' window: episodes finished before the first step stay in its row."""
        return self._ask(self.rollout.engines_active_s.remote(), "engines_active_s")

    def admit(self, version: int) -> ray.ObjectRef:
        """Tell the rollout worker that engines serve `version` now (the buffer admits by it);
        returns at once. `admitted` waits for its answer."""
        return self.rollout.admit.remote(version)

    def admitted(self, ref: ray.ObjectRef) -> dict[str, float]:
        """The answer of `admit`: the worker's counters read just before (`RolloutWorker.metrics`)."""
        return self._ask(ref, "admit")

    def start_eval(self) -> None:
        """Queue an evaluation on the rollout worker (`moe_rl.rollout.evaluation`); returns at once."""
        self._ask(self.rollout.start_eval.remote(), "start_eval")

    def finished_evals(self, wait: bool = False) -> tuple[list, int]:
        """Evaluations finished since the last call, and how many still run (`wait`: none)."""
        return self._wait(self.rollout.finished_evals.remote(wait))

    def drain(self) -> float:
        """Wait until no group is generating (drain-before-sync); recovers engines meanwhile."""
        return self._wait(self.rollout.drain.remote())

    def start_probe(self, ids: list[list[int]], request: ProbeRequest) -> ray.ObjectRef:
        """The rollout worker starts scoring the consistency probe's sequences (`TrainBatch.probe_ids`;
        `moe_rl.rl.consistency_probe`) beside the rollout; returns at once: the trainer ranks take
        the ref, `probe_scored` waits for it."""
        return self.rollout.score_probe.remote(ids, request)

    def probe_scored(self, scoring: ray.ObjectRef) -> ProbeBatch | str:
        """The answer of `start_probe`: the probe batch, or why it is skipped; recovers engines
        while it waits (a restarted engine scores it)."""
        return self._wait(scoring)

    def start_trace(self) -> None:
        """Every process records its spans (`moe_rl.trace`): the driver, each trainer rank, the
        rollout worker and each embedded engine."""
        TRACER.start()
        self.trainer.start_trace()
        self._ask(self.rollout.start_trace.remote(), "start_trace")

    def stop_trace(self) -> list[dict]:
        """Stop recording; every process's spans (driver, trainer ranks, rollout worker, engines)."""
        driver = TRACER.stop()
        return [driver, *self.trainer.stop_trace(), *self._ask(self.rollout.stop_trace.remote(), "stop_trace")]

    def _ask(self, ref: ray.ObjectRef, call: str):
        """The answer of a rollout-worker control call (milliseconds of work), or an error naming
        the call after `rl.call_timeout_s`: no silent hang on a wedged worker."""
        try:
            return ray.get(ref, timeout=self.config.rl.call_timeout_s)
        except GetTimeoutError:
            deadline = self.config.rl.call_timeout_s
            raise RuntimeError(
                f"the rollout worker did not answer `{call}` within rl.call_timeout_s={deadline:g} s; "
                f"`moe-rl stacks {self.run_dir} 'rollout worker'` shows where it is"
            ) from None

    def _wait(self, ref: ray.ObjectRef):
        while not ray.wait([ref], timeout=_POLL_S)[0]:
            self.recover()  # generation may be waiting for a restarted engine
        return ray.get(ref)

    def sync(self, version: int) -> dict[str, float]:
        """Weight update to `version` on every live engine (dead ones are dropped and restarted);
        returns its metrics: `time/sync_s`, and with `sync.delta` what it carried (`SyncResult.metrics`)."""
        lost, self.lost = self.lost, []
        # engines a peer fed since the last sync serve the committed version: members from now on
        joined = self.joins.take_pending()
        request = SyncRequest(
            version, self.config.sync.bucket_bytes, joined=joined, served_version=self.version, lost=tuple(lost)
        )
        result = self.trainer.sync_weights(request)
        self.version = version
        for name in result.dropped:
            self._ask(self.rollout.mark_dead.remote(engine_index(name)), "mark_dead")
        self.recover()
        return {"time/sync_s": result.seconds, **result.metrics}

    def engine_states(self) -> list[dict]:
        """Per engine slot, the rollout pool's view (`RolloutWorker.engine_states`)."""
        return self._ask(self.rollout.engine_states.remote(), "engine_states")

    def recover(self) -> None:
        """Restart dead engines; bring restarted ones to the committed version (`moe_rl.rl.joins`)
        and put them back in the pool; serve `moe-rl engines` requests (`EngineFleet.poll`)."""
        states = self.engine_states()
        for index, state in enumerate(states):
            if not state["live"] and not state["removed"] and index not in self.restarting:
                self.restarting[index] = self.servers[index].restart.remote()
                self.restarts += 1
                self.joins.forget(index)  # fed by a peer but not yet a member: nothing to remove there
                self.lost.append(engine_name(index))
        for index, restarted in list(self.restarting.items()):
            if index in self.joins.active or not ray.wait([restarted], timeout=0)[0]:
                continue
            url = ray.get(restarted)
            self.joins.start(index, url, done=functools.partial(self._restarted, index, url))
        self.joins.poll()
        if self.fleet is not None:
            self.fleet.poll()

    def _restarted(self, index: int, url: str, serving: bool) -> None:
        """Engine `index`'s restart is over: it serves the committed version (give it work), or it
        died again while catching up (restarted next time)."""
        del self.restarting[index]
        if serving:
            self._ask(self.rollout.revive.remote(index, url), "revive")

    def url_of(self, index: int) -> str:
        return ray.get(self.servers[index].url.remote())

    def catch_up(self, joined: dict[str, str]) -> list[str]:
        """The trainer's sender takes in engines (name -> URL) serving the starting checkpoint
        and sends them the committed version: a weight-update group of them only, the others keep
        generating. Returns the names of those that died on the way."""
        for name in joined:  # the sender replaces the dead member with the restarted one
            if name in self.lost:
                self.lost.remove(name)
        request = SyncRequest(
            self.version, self.config.sync.bucket_bytes, joined=joined, served_version=self.initial_version
        )
        return self.trainer.sync_weights(request).dropped

    def _start_engines(self) -> None:
        """One `EngineServer` actor per engine, placed by `engine_placement`."""
        cfg = self.config
        colocated = cfg.engines.kind == "sglang" and cfg.rl.colocate
        devices = self.trainer.devices() if colocated else None
        for i, (options, gpu_ids) in enumerate(engine_placement(cfg.engines, cfg.rl.colocate, devices)):
            if "bundle" in options:
                options = dict(
                    options,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self.trainer.placement, options.pop("bundle")),
                )
            self.servers[i] = self.start_engine(
                i, options, gpu_ids, cfg.cpu_pools.engines[i] if cfg.cpu_pools else None
            )

    def _adopt_engines(self) -> None:
        """The kept engine servers: their restarts now start on the resumed checkpoint. One whose
        actor is gone (its node with it) is replaced by a new engine."""
        cfg = self.config
        # the dead trainer's weight-update groups: one per pipeline stage, or one (sync.stages)
        stages = cfg.trainer.pp
        groups = sorted({cfg.sync.group_name, *(stage_config(cfg.sync, s, stages).group_name for s in range(stages))})
        adopted = {
            index: server.adopt.remote(self.initial_dir, self.initial_version, groups)
            for index, server in self.servers.items()
        }
        for index, ref in adopted.items():
            try:
                ray.get(ref, timeout=cfg.rl.call_timeout_s)
            except (RayActorError, GetTimeoutError):
                ray.kill(self.servers[index])
                options, _ = engine_placement(cfg.engines, colocate=False)[0]
                cpus = cfg.cpu_pools.engines[index] if cfg.cpu_pools else None
                self.servers[index] = self.start_engine(index, options, cpus=cpus)

    def detach_engines(self) -> list[ray.actor.ActorHandle]:
        """After a trainer fault: the engine servers, in index order, taken out of this cluster so
        that `close` leaves them (and Ray) running for the restarted trainer, which rolls them back
        to its version. None where they cannot outlive the trainer: colocated (they live in its
        GPUs' bundles), or with LoRA (they hold adapters of the discarded versions)."""
        if self.config.rl.colocate or self.config.lora is not None:
            return []
        kept, self.servers, self.detached = self.engines, {}, True
        return kept

    def start_engine(
        self, index: int, options: dict, gpu_ids: list[str] | None = None, cpus: list[int] | None = None
    ) -> ray.actor.ActorHandle:
        """Engine `index`'s `EngineServer` (Ray `options` from `engine_placement`) on the run's
        starting checkpoint; returns at once, its process starts in the actor."""
        cfg, log = self.config, str(self.run_dir / f"{engine_name(index)}.log")
        server = ray.remote(EngineServer).options(**options)
        return server.remote(
            self.initial_dir, cfg.engines, log, self.initial_version, gpu_ids, self._lora_slots(), cpus,
            cfg.sync.delta.enabled,
        )  # fmt: skip

    def _lora_slots(self):
        return sglang_lora_slots(self.config)

    def close(self) -> dict | None:
        ledger = None
        try:
            if self.fleet is not None:
                self.fleet.close()
            if self.joins is not None:
                self.joins.close()
            if self.rollout is not None:
                ledger = ray.get(self.rollout.stop.remote())
        finally:
            if self.trainer is not None:
                self.trainer.close()
            for server in self.engines + self.served:
                ray.get(server.stop.remote())
            if not self.detached:  # kept engines live in this Ray
                ray.shutdown()
            if self.config.cpu_pools is not None:
                pin_process(self.cores_before_pinning)
        return ledger


_POLL_S = 0.2  # how often the driver looks for dead and restarted engines while it waits
_LOCAL_SPARE_CPUS = 4
"""Logical CPUs a local Ray holds beyond the run's actors: room for `moe-rl engines add` (an
embedded engine asks one; unused logical CPUs cost nothing). Joined clusters have their own."""
