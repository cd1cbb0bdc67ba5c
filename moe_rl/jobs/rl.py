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
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from moe_rl.config import RunConfig, dump_config, to_dict
from moe_rl.jobs.evaluations import DriverEvaluations
from moe_rl.metrics import MetricsLogger
from moe_rl.progress import StepProgress
from moe_rl.report import write_report
from moe_rl.rl import resume as resume_state
from moe_rl.rl.cluster import RLCluster
from moe_rl.rl.colocate import engines_released
from moe_rl.rl.consistency_probe import PROBE_PREFIX, ProbeRequest, probe_due
from moe_rl.rl.rollout_actor import BatchRequest
from moe_rl.rl.step_clock import StepClock
from moe_rl.rl.trainer_group import SaveHFRequest
from moe_rl.rollout.dump import ROLLOUTS_DIR, SampleDump
from moe_rl.rollout.expert_load import EXPERTS_FILE, write_expert_load
from sync.lora import adapter_name

log = logging.getLogger(__name__)


def run(config: RunConfig, resume: bool = False) -> dict:
    """Train `config.steps` RL steps; writes metrics, plots and `final_hf/` to `config.output_dir`.
    `resume`: continue from the newest run checkpoint in `config.output_dir`."""
    run_dir = Path(config.output_dir)
    restore, first = None, 0
    if resume:
        restore = resume_state.load_run_checkpoint(resume_state.latest_checkpoint(run_dir))
        first = restore.step
        for name in ("metrics.jsonl", EXPERTS_FILE, resume_state.TRAINED_FILE):  # steps after the checkpoint are redone
            resume_state.truncate_rows(run_dir / name, restore.metrics_offset)
        SampleDump(run_dir / ROLLOUTS_DIR).remove_after(restore.step)  # and their rollout dumps
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_config(config, run_dir / "config.json")
    rollout = config.effective_rollout()
    start = time.perf_counter()
    logger = MetricsLogger(run_dir, wandb_project=config.rl.wandb_project, config=to_dict(config))
    cluster = RLCluster(config, run_dir, restore)
    hold = config.rl.mode == "sync" or (config.eval is not None and config.eval.hold_sync)
    evaluations = DriverEvaluations(config.eval, cluster, logger, run_dir, hold_sync=hold)
    if restore is not None:
        evaluations.remove_after(restore.step)
    dumps = SampleDump(run_dir / ROLLOUTS_DIR) if rollout.dump else None  # records come from the worker
    rewards, trained, ledger = [], [], None
    row_multiple = config.algorithm.num_mini_batches * config.trainer.micro_batch_size * config.trainer.dp
    try:
        setup_s = time.perf_counter() - start
        clock = StepClock(
            cluster.rollout_metrics()["engines/active_s"],
            colocate=config.rl.colocate,
            full_weight_sync=config.lora is None,
        )
        if first == 0:
            evaluations.step_done(0, config.steps)  # eval.at_start
        with StepProgress("rl", config.steps - first) as progress:
            for version in range(first, config.steps):
                # 1. batch: the next groups the staleness bound admits, built into tensors by the
                #    rollout worker; the driver gets their ObjectRef and the metadata it logs (and
                #    on a probe's step the ids of the probe's few sequences)
                clock.start()
                probe = probe_due(config.trainer.consistency_probe_every, version + 1)
                request = BatchRequest(
                    rollout.groups_per_step,
                    version,
                    config.algorithm,
                    row_multiple,
                    dump=dumps is not None,
                    probe_samples=config.trainer.consistency_probe_samples if probe else 0,
                )
                batch = cluster.get_batch(request)
                metrics = clock.waited()
                info = batch.info
                trained += info.group_ids
                metrics["perf/driver_batch_bytes"] = batch.driver_bytes()
                metrics["perf/batch_tensor_bytes"] = batch.tensor_bytes
                # 2. train (colocated engines give their memory back meanwhile); each rank resolves the ref
                with (
                    clock.training(),
                    engines_released(cluster.engines, config.engines.kind, config.rl.colocate, metrics),
                ):
                    metrics.update(cluster.trainer.step(batch.tensors, config.algorithm, version + 1))
                # 3. update the engines' weights to version + 1 (eval.hold_sync: after the running evaluation)
                evaluations.before_sync()
                metrics.update(_update_weights(cluster, config, version + 1))
                # read before admitting the next round: the worker answers after starting its requests
                rollout_metrics = cluster.rollout_metrics()
                # 4. admit: the engines serve version + 1, so the rounds it allows may start
                cluster.set_rollout_version(version + 1)
                metrics.update(evaluations.step_done(version + 1, config.steps))
                # 5. every trainer.consistency_probe_every steps: an engine scores a few of the batch's
                #    sequences under version + 1 and the trainer runs the same ids (the rollout goes on)
                if probe:
                    metrics.update(_probe(cluster, config, batch.probe_ids, version + 1))
                # 6. log
                metrics.update({**info.metrics(), **rollout_metrics})
                metrics.update(clock.finish(metrics, rollout_metrics))
                logger.log(version + 1, metrics)
                if info.expert_counts is not None:  # the layer x expert load, for plots/experts.png
                    write_expert_load(run_dir, version + 1, info.moe_layers, info.expert_counts)
                resume_state.record_trained(run_dir, version + 1, info.group_ids)
                if dumps is not None:  # rollout.dump: the samples trained at this step (before its checkpoint)
                    dumps.write(version + 1, batch.records)
                # 7. checkpoint the run every `rl.checkpoint_every` steps and at the last
                every = config.rl.checkpoint_every
                if every and ((version + 1) % every == 0 or version + 1 == config.steps):
                    evaluations.collect(wait=True)  # every evaluation up to here is logged before it
                    resume_state.save_run_checkpoint(cluster, run_dir, version + 1, config.rl.keep_checkpoints)
                rewards.append(metrics["rollout/reward_mean"])
                progress.advance(
                    f"reward {rewards[-1]:.3f}  staleness {metrics['rollout/staleness_mean']:.2f}  "
                    f"sync {metrics['time/sync_s']:.2f}s  step {metrics['time/step_s']:.2f}s"
                )
        train_s = time.perf_counter() - start - setup_s
        evaluations.collect(wait=True)  # eval.at_end's evaluation of the final policy
        if config.rl.save_hf:  # with LoRA: merged (base + adapter), for engines without LoRA
            cluster.trainer.save_hf(SaveHFRequest(str(run_dir / "final_hf")))
        if config.lora is not None:
            cluster.trainer.save_adapter(str(run_dir / "final_adapter"))
    finally:
        ledger = cluster.close()
        logger.close()
    if config.rl.report:
        write_report(run_dir)
    window = max(1, min(10, len(rewards) // 4))
    return {
        "reward_first": sum(rewards[:window]) / window,
        "reward_last": sum(rewards[-window:]) / window,
        "rewards": rewards,
        "setup_s": setup_s,
        "train_s": train_s,
        "wall_s": time.perf_counter() - start,
        "trained_group_ids": trained,
        "ledger": ledger,
        "run_dir": str(run_dir),
    }


def _update_weights(cluster: RLCluster, config: RunConfig, version: int) -> dict[str, float]:
    """The weight update, as numbered steps (the caller then admits the rounds `version` allows)."""
    metrics = {}
    # 1. one_step_off: let in-flight generation finish, so no sample mixes two versions
    if config.rl.drain_before_sync:
        metrics["time/drain_s"] = cluster.drain()
    # 2. pause engines (sync.pause_mode), stream buckets, commit `version`, resume (WeightSender)
    #    (an engine that died is dropped, the others commit; it is restarted and caught up later)
    metrics["time/sync_s"] = cluster.sync(version)
    metrics["engines/restarts"] = cluster.restarts
    return metrics


def _probe(cluster: RLCluster, config: RunConfig, ids: list[list[int]], version: int) -> dict[str, float]:
    """The consistency probe of `version` (the engines serve it now; `moe_rl.rl.consistency_probe`):
    the rollout worker scores `ids` (a few of the step's sequences), the trainer ranks compare. A
    probe the engines cannot answer on `version` is skipped, and says so."""
    start = time.perf_counter()
    request = ProbeRequest(
        version,
        routing=config.trainer.routing_replay,
        lora_path=adapter_name(version) if config.lora is not None else None,
    )
    scored = cluster.score_probe(ids, request)
    if isinstance(scored, str):
        log.warning("consistency probe of version %d skipped: %s", version, scored)
        metrics = {f"{PROBE_PREFIX}skipped": 1.0}
    else:
        metrics = {**cluster.trainer.probe(scored), f"{PROBE_PREFIX}skipped": 0.0}
    metrics["time/consistency_probe_s"] = time.perf_counter() - start
    return metrics
