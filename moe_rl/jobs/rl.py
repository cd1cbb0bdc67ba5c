"""The RL job: the async loop of docs/architecture.md section 2, on Ray actors (see `moe_rl.rl.cluster`).

One loop serves every mode; modes only set the staleness bound and whether generation drains
before a weight sync (`RLConfig`): `sync` = staleness 0 (round v+1 is not admitted until the
engines serve v+1, so generation and training alternate), `one_step_off` = staleness 1 +
drain-before-sync, `fully_async` = staleness >= 1, generation paused only for the weight swap
(requests cut by it continue as partial rollouts). Runs on the driver; returns a summary.
With `lora:`, each sync publishes only the new adapter and the run ends with `final_adapter/` (PEFT)
next to the merged `final_hf/`. With `rl.checkpoint_every`, run checkpoints (`moe_rl.rl.resume`) let
`--resume` continue a run. With `eval:`, evaluations run on the rollout engines
(`moe_rl.jobs.evaluations`). Every `trainer.consistency_probe_every` steps the consistency probe
measures train/inference mismatch on the step's own version (`moe_rl.rl.consistency_probe`).
The config must have passed `moe_rl.jobs.preflight.check_run` (the train command runs it before
anything starts).

Faults: a trainer rank that dies or misses `rl.call_timeout_s` (`TrainerFault`) makes the driver
tear the trainer and the rollout worker down and start them again from the newest run checkpoint,
through the same path as `--resume` (rows of redone steps replaced, no group trained twice), up to
`rl.max_restarts` times (`faults/trainer_restarts`, `faults/steps_redone`, `faults/restart_s`). The
engines keep running and are rolled back to the checkpoint's version by the new trainer's first
sync (`RLCluster.detach_engines`). SIGTERM / SIGUSR1 stop the
run at the end of a step with a run checkpoint (`moe_rl.rl.preemption`; `summary["preempted"]`).
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray

from moe_rl.config import RunConfig, dump_config, to_dict
from moe_rl.engine.client import engine_name
from moe_rl.gc_freeze import freeze_setup, thaw
from moe_rl.jobs.evaluations import DriverEvaluations
from moe_rl.metrics import MetricsLogger
from moe_rl.progress import StepProgress
from moe_rl.report import write_report
from moe_rl.rl import resume as resume_state
from moe_rl.rl import stacks
from moe_rl.rl.cluster import RLCluster
from moe_rl.rl.colocate import engines_released
from moe_rl.rl.consistency_probe import ProbeRequest, probe_due, probe_metrics
from moe_rl.rl.preemption import StopSignals
from moe_rl.rl.resume import RunCheckpoint
from moe_rl.rl.rollout_actor import BatchRequest
from moe_rl.rl.step_clock import StepClock, TraceWindow
from moe_rl.rl.trainer_group import SaveHFRequest, TrainerFault
from moe_rl.rollout.dump import ROLLOUTS_DIR, SampleDump
from moe_rl.rollout.expert_load import EXPERTS_FILE, write_expert_load
from moe_rl.rollout.train_batch import BatchInfo
from moe_rl.trace import TRACE_FILE, TRACER
from sync.lora import adapter_name

log = logging.getLogger(__name__)


@dataclass
class StepRow:
    """A step's metrics row, written while the next step trains: it waits for the admit's answer
    (the rollout worker's counters), which the trainer need not wait for."""

    step: int
    metrics: dict[str, float]
    info: BatchInfo
    records: list | None
    admitted: ray.ObjectRef
    probe: ray.ObjectRef | None = None
    """The engines' scoring of this step's consistency probe, which the next step's train step
    compares before its update: the row waits for that step's metrics."""


@dataclass
class Faults:
    """The trainer faults this job survived (logged with every step as `faults/*`)."""

    restarts: int = 0
    steps_redone: int = 0
    restart_s: float = 0.0  # from each fault to its resumed loop's start, summed
    since: float | None = None  # the fault being recovered from (perf_counter)
    resumed_from: list[int] = field(default_factory=list)  # the step each restart resumed at
    engines: list[ray.actor.ActorHandle] = field(default_factory=list)  # engine servers kept through the last fault

    def metrics(self) -> dict[str, float]:
        return {
            "faults/trainer_restarts": self.restarts,
            "faults/steps_redone": self.steps_redone,
            "faults/restart_s": self.restart_s,
        }


@dataclass
class Attempt:
    """What one start of the run's processes ended with."""

    setup_s: float
    train_s: float
    ledger: dict | None
    preempted: str | None  # the stop signal honoured, or None: the run finished


def run(config: RunConfig, resume: bool = False, stop: StopSignals | None = None) -> dict:
    """Train `config.steps` RL steps; writes metrics, plots and `final_hf/` to `config.output_dir`.
    `resume`: continue from the newest run checkpoint in `config.output_dir`. `stop`: the stop
    signals caught since the command started (`moe-rl train`), else caught from here on."""
    if stop is None:
        with StopSignals(config.rl.stop_grace_s) as stop:
            return run(config, resume, stop)
    stop.set_grace(config.rl.stop_grace_s)
    run_dir = Path(config.output_dir)
    TRACER.process = "driver"
    start, faults = time.perf_counter(), Faults()
    while True:
        try:
            restore = _rewind(run_dir, resume, faults, config.rollout.mixture_signature())
            attempt = _attempt(config, restore, stop, faults)
            break
        except TrainerFault as fault:
            if faults.restarts >= config.rl.max_restarts:
                raise TrainerFault(
                    f"{fault}; rl.max_restarts={config.rl.max_restarts} restarts spent: the run ends "
                    f"(continue it with `moe-rl train --resume {run_dir}`)"
                ) from None
            faults.restarts, faults.since, resume = faults.restarts + 1, time.perf_counter(), True
            log.warning(
                "%s: restarting the trainer from the newest run checkpoint (restart %d of rl.max_restarts=%d)",
                fault,
                faults.restarts,
                config.rl.max_restarts,
            )
    if config.rl.report:
        write_report(run_dir)
    rows = resume_state.read_rows(run_dir / "metrics.jsonl")  # the steps' rows, and evaluations' of their own
    rewards = [row["rollout/reward_mean"] for row in rows if "rollout/reward_mean" in row]
    trained = [g for row in resume_state.read_rows(run_dir / resume_state.TRAINED_FILE) for g in row["groups"]]
    window = max(1, min(10, len(rewards) // 4))
    return {
        "reward_first": sum(rewards[:window]) / window,
        "reward_last": sum(rewards[-window:]) / window,
        "rewards": rewards,
        "setup_s": attempt.setup_s,
        "train_s": attempt.train_s,
        "wall_s": time.perf_counter() - start,
        "trained_group_ids": trained,
        "ledger": attempt.ledger,
        "preempted": attempt.preempted,
        "faults": faults.metrics(),
        "resumed_from": faults.resumed_from,
        "run_dir": str(run_dir),
    }


def _rewind(run_dir: Path, resume: bool, faults: Faults, mixture: list | None) -> RunCheckpoint | None:
    """Where this start begins: nothing (a fresh run), or the newest run checkpoint with every row
    and dump of the steps after it dropped (they are redone); its task mixture must be `mixture`.
    After a trainer fault with no checkpoint yet, the run starts over from step 0."""
    if not resume:
        return None
    if faults.since is not None and not resume_state.complete_checkpoints(run_dir):
        restore, step = None, 0
    else:
        restore = resume_state.load_run_checkpoint(resume_state.latest_checkpoint(run_dir))
        resume_state.check_mixture(mixture, restore)
        step = restore.metrics_offset
    if faults.since is not None:
        faults.steps_redone += resume_state.steps_after(run_dir / "metrics.jsonl", step)
        faults.resumed_from.append(step)
    for name in ("metrics.jsonl", EXPERTS_FILE, resume_state.TRAINED_FILE):
        resume_state.truncate_rows(run_dir / name, step)
    SampleDump(run_dir / ROLLOUTS_DIR).remove_after(step)
    return restore


def _attempt(config: RunConfig, restore: RunCheckpoint | None, stop: StopSignals, faults: Faults) -> Attempt:
    """Start the run's processes (from `restore`, or fresh) and train until `config.steps`, a stop
    signal, or a `TrainerFault`."""
    run_dir = Path(config.output_dir)
    first = restore.step if restore is not None else 0
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_config(config, run_dir / "config.json")
    rollout = config.effective_rollout()
    start = time.perf_counter()
    logger = MetricsLogger(run_dir, wandb_project=config.rl.wandb_project, config=to_dict(config))
    stacks.forget_processes(run_dir)  # the last start's pids may belong to other processes by now
    kept, faults.engines = faults.engines, []  # the cluster owns them now (and stops them if it fails)
    try:
        cluster = RLCluster(config, run_dir, restore, kept)
    except BaseException:
        logger.close()
        raise
    freeze_setup()  # Ray's, the config's and the cluster's objects: out of the collector's full passes
    hold = config.rl.mode == "sync" or (config.eval is not None and config.eval.hold_sync)
    evaluations = DriverEvaluations(config.eval, cluster, logger, run_dir, hold_sync=hold)
    evaluations.remove_after(first)
    dumps = SampleDump(run_dir / ROLLOUTS_DIR) if rollout.dump else None  # records come from the worker
    ledger, preempted = None, None
    row_multiple = config.algorithm.num_mini_batches * config.trainer.micro_batch_size * config.trainer.dp

    def ask_batch(version: int) -> ray.ObjectRef:
        """Ask the rollout worker for the batch that trains `version` -> `version` + 1 (and, on a
        probe's step, the ids of the probe's few sequences); the answer arrives when it is built."""
        probe = probe_due(config.trainer.consistency_probe_every, version + 1)
        request = BatchRequest(
            rollout.groups_per_step,
            version,
            config.algorithm,
            row_multiple,
            dump=dumps is not None,
            probe_samples=config.trainer.consistency_probe_samples if probe else 0,
        )
        return cluster.ask_batch(request)

    def checkpoint_due(step: int) -> bool:
        every = config.rl.checkpoint_every
        return bool(every) and (step % every == 0 or step == config.steps)

    asked = None  # the next step's batch, asked for while this step trains

    def write_row(row: StepRow) -> None:
        """6. log the step: its metrics row (with the rollout worker's counters, which the admit
        answered), the expert load, the groups it trained and, with rollout.dump, its samples."""
        log_start = time.time()
        rollout_metrics = cluster.admitted(row.admitted)
        metrics = {**row.metrics, **row.info.metrics(), **rollout_metrics}
        metrics.update(clock.finish(metrics, rollout_metrics))
        metrics.update(faults.metrics())
        logger.log(row.step, metrics)
        if row.info.expert_counts is not None:  # the layer x expert load, for plots/experts.png
            write_expert_load(run_dir, row.step, row.info.moe_layers, row.info.expert_counts)
        resume_state.record_trained(run_dir, row.step, row.info.group_ids)
        if dumps is not None:  # rollout.dump: the samples trained at this step (before its checkpoint)
            dumps.write(row.step, row.records)
        TRACER.add("log", log_start, time.time())
        progress.advance(
            f"reward {metrics['rollout/reward_mean']:.3f}  staleness {metrics['rollout/staleness_mean']:.2f}  "
            f"sync {metrics['time/sync_s']:.2f}s  step {metrics['time/step_s']:.2f}s"
        )

    try:
        stacks.record_processes(run_dir, _processes(cluster, run_dir))
        setup_s = time.perf_counter() - start
        if faults.since is not None:
            faults.restart_s, faults.since = faults.restart_s + time.perf_counter() - faults.since, None
        clock = StepClock(
            cluster.engines_active_s(),
            colocate=config.rl.colocate,
            full_weight_sync=config.lora is None,
        )
        window = TraceWindow(cluster, run_dir / TRACE_FILE, first, config.steps, config.rl.trace_steps)
        checkpoints = resume_state.RunCheckpointer(
            cluster, run_dir, config.rl.keep_checkpoints, config.rl.checkpoint_background
        )
        if first == 0:
            evaluations.step_done(0, config.steps)  # eval.at_start
        row = None  # the last step's, unless that step checkpointed or ended the run
        # a stop signal (preemption) is honoured at the end of a step whose successor's batch was not
        # asked for yet (that batch's groups would be in no checkpoint): this step or the next
        with StepProgress("rl", config.steps, first=first) as progress:
            for version in range(first, config.steps):
                window.begin(version)  # rl.trace_steps: every process records its spans
                step_start = time.time()
                # 1. batch: the next groups the staleness bound admits, built into tensors by the
                #    rollout worker; the driver gets their ObjectRef and the metadata it logs. It was
                #    asked for while the previous step trained (1b), unless that step checkpointed.
                clock.start()
                with TRACER.span("wait for batch"):
                    batch = cluster.get_batch(asked or ask_batch(version))
                metrics = clock.waited()
                # 1b. ask for the next step's batch now, so that the rollout worker builds it while
                #     this step trains and syncs; not when this step checkpoints (the checkpoint's
                #     rollout state must still hold the groups that batch takes)
                last = version + 1 == config.steps
                ahead = not (last or checkpoint_due(version + 1) or stop.requested)
                asked = ask_batch(version + 1) if ahead else None
                info = batch.info
                metrics["perf/driver_batch_bytes"] = batch.driver_bytes()
                metrics["perf/batch_tensor_bytes"] = batch.tensor_bytes
                # 2. train (colocated engines give their memory back meanwhile); each rank resolves the
                #    ref. Meanwhile the driver writes the previous step's row (6).
                with (
                    TRACER.span("train"),
                    clock.training(),
                    engines_released(cluster.engines, config.engines.kind, config.rl.colocate, metrics),
                ):
                    probing = row.probe if row is not None else None  # the last step's probe (5)
                    training = cluster.trainer.start_step(batch.tensors, config.algorithm, version + 1, probing)
                    if probing is not None:
                        _probe_scored(cluster, probing, version)
                    elif row is not None:
                        write_row(row)
                        row = None
                    metrics.update(cluster.trainer.step_result(training))
                    if probing is not None:  # that row waited for the probe's metrics
                        row.metrics.update(probe_metrics(metrics))
                        write_row(row)
                        row = None
                    checkpoints.complete()  # run checkpoints whose background writes are done
                # 3. update the engines' weights to version + 1 (eval.hold_sync: after the running evaluation)
                with TRACER.span("weight sync"):
                    evaluations.before_sync()
                    metrics.update(_update_weights(cluster, config, version + 1))
                # 4. admit: the engines serve version + 1, so the rounds it allows may start (the
                #    worker's counters, read before it starts them, come back for the row: the
                #    next step does not wait for them)
                with TRACER.span("admit"):
                    admitted = cluster.admit(version + 1)
                with TRACER.span("evaluations"):
                    metrics.update(evaluations.step_done(version + 1, config.steps))
                # 5. every trainer.consistency_probe_every steps: an engine scores a few of the batch's
                #    sequences under version + 1, beside the rollout, and the trainer runs the same ids
                #    on the same weights: in the next step, before its update (the scoring's wait is
                #    then that step's forward-backward), or now when no next step was asked for or
                #    colocated engines give their memory back while it trains
                scoring = None
                if batch.probe_ids is not None:
                    scoring = cluster.start_probe(batch.probe_ids, _probe_request(config, version + 1))
                    if asked is None or config.rl.colocate:
                        with TRACER.span("consistency probe"):
                            _probe_scored(cluster, scoring, version + 1)
                            metrics.update(cluster.trainer.probe([scoring]))
                        scoring = None
                # 6. the step's row: written while the next step trains, now if this step
                #    checkpoints or ends the run
                metrics.update(clock.end(metrics))
                records = batch.records if dumps is not None else None
                row = StepRow(version + 1, metrics, info, records, admitted, probe=scoring)
                stopping = stop.requested is not None and asked is None and not last
                if last or stopping or checkpoint_due(version + 1):
                    write_row(row)
                    row = None
                # 7. checkpoint the run every `rl.checkpoint_every` steps, at the last, and at a stop signal
                if checkpoint_due(version + 1) or stopping:
                    with TRACER.span("checkpoint"):
                        evaluations.collect(wait=True)  # every evaluation up to here is logged before it
                        checkpoints.save(version + 1)
                        if stopping:
                            checkpoints.complete(blocking=True)
                TRACER.add(f"step {version + 1}", step_start, time.time(), lane="steps")
                window.end(version)
                if stopping:
                    preempted = stop.requested
                    log.warning("%s: run checkpoint of step %d written; stopping", preempted, version + 1)
                    break
        checkpoints.complete(blocking=True)
        train_s = time.perf_counter() - start - setup_s
        if preempted is None:
            evaluations.collect(wait=True)  # eval.at_end's evaluation of the final policy
            if config.rl.save_hf:  # with LoRA: merged (base + adapter), for engines without LoRA
                cluster.trainer.save_hf(SaveHFRequest(str(run_dir / "final_hf")))
            if config.lora is not None:
                cluster.trainer.save_adapter(str(run_dir / "final_adapter"))
    except TrainerFault as fault:  # the ranks' stacks, before their processes go
        path = stacks.save_stacks(run_dir, "trainer rank", f"fault_{faults.restarts + 1}.txt", str(fault))
        log.warning("the trainer ranks' stacks at the fault: %s", path)
        if faults.restarts < config.rl.max_restarts:  # the restarted trainer rolls them back to its version
            faults.engines = cluster.detach_engines()
        raise
    finally:
        ledger = cluster.close()
        logger.close()
        thaw()  # a driver that goes on (tests, a notebook) may collect what this start froze
    return Attempt(setup_s, train_s, ledger, preempted)


def _processes(cluster: RLCluster, run_dir: Path) -> list[stacks.RunProcess]:
    """This start's processes, each dumping its stacks on SIGUSR2 (`moe-rl stacks`): the driver, the
    trainer ranks, the rollout worker and the engines (embedded ones into their logs)."""
    here = [stacks.enable_stack_dumps(run_dir, "driver"), *cluster.trainer.enable_stack_dumps(str(run_dir))]
    here.append(ray.get(cluster.rollout.__ray_call__.remote(_enable_stack_dumps, str(run_dir), "rollout worker")))
    for index, engine in sorted(cluster.servers.items()):
        pid = ray.get(engine.pid.remote())
        host, log_path = ray.get(engine.__ray_call__.remote(lambda server: (socket.gethostname(), server.log_path)))
        log_file = log_path if cluster.config.engines.kind == "embedded" else None  # kept engines keep theirs
        here.append(stacks.RunProcess(engine_name(index), host, pid, log_file))
    return here


def _enable_stack_dumps(_actor, run_dir: str, name: str) -> stacks.RunProcess:
    """`enable_stack_dumps` inside an actor's process (through `__ray_call__`)."""
    return stacks.enable_stack_dumps(run_dir, name)


def _update_weights(cluster: RLCluster, config: RunConfig, version: int) -> dict[str, float]:
    """The weight update, as numbered steps (the caller then admits the rounds `version` allows)."""
    metrics = {}
    # 1. one_step_off: let in-flight generation finish, so no sample mixes two versions
    if config.rl.drain_before_sync:
        metrics["time/drain_s"] = cluster.drain()
    # 2. pause engines (sync.pause_mode), stream buckets, commit `version`, resume (WeightSender)
    #    (an engine that died is dropped, the others commit; it is restarted and caught up later)
    metrics.update(cluster.sync(version))  # time/sync_s (+ delta/* with sync.delta)
    metrics["engines/restarts"] = cluster.restarts
    metrics.update(cluster.joins.metrics())  # engines/join_* (`moe_rl.rl.joins`)
    return metrics


def _probe_request(config: RunConfig, version: int) -> ProbeRequest:
    """How the engines score the consistency probe of `version` (`moe_rl.rl.consistency_probe`)."""
    return ProbeRequest(
        version,
        routing=config.trainer.routing_replay,
        lora_path=adapter_name(version) if config.lora is not None else None,
    )


def _probe_scored(cluster: RLCluster, scoring: ray.ObjectRef, version: int) -> None:
    """Wait for the engines' scoring of the probe of `version` (engines recover meanwhile; the
    trainer ranks take it themselves) and say why when they could not score it on that version."""
    scored = cluster.probe_scored(scoring)
    if isinstance(scored, str):
        log.warning("consistency probe of version %d skipped: %s", version, scored)
