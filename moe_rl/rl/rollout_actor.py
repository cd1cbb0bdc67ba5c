"""Ray actors of the generation side: an engine server per `EngineServer`, one `RolloutWorker`.

`EngineServer` owns an engine server process (the embedded CPU engine here; SGLang through the
same launcher on GPUs) for its lifetime: Ray places and restarts actors, the actor starts and
stops its process. `RolloutWorker` is an async actor: the `RolloutManager` runs on its event
loop and keeps generating while the driver trains; the driver's calls (`get_batch`,
`admit`, `drain`) are coroutines on the same loop, so they never block generation.

The batch stays off the driver: `get_batch` builds the trainer's tensors here (`build_batch`, in a
thread, so generation goes on), puts them in Ray's object store and answers a `TrainBatch`: their
ObjectRef and the metadata the driver logs. Each trainer rank resolves the ref itself; the driver
never holds a token, logprob or routing row (only dump records, with `rollout.dump`).
Evaluations (`moe_rl.rollout.evaluation`) run on that loop too, one at a time in the order the
driver asks for them (`start_eval`); each evaluates the version the engines serve when it begins.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import pickle
import time
from typing import Any

import ray

from moe_rl.algorithms import AlgorithmConfig
from moe_rl.cpu_pools import pin_process
from moe_rl.engine.client import EngineClient, EngineError, engine_name
from moe_rl.engine.pool import EnginePool
from moe_rl.engine.process import EmbeddedConfig, launch_embedded
from moe_rl.engine.sglang_launcher import launch_sglang
from moe_rl.gc_freeze import freeze_setup
from moe_rl.plan.launch import engine_sglang_config
from moe_rl.rl.consistency_probe import ProbeBatch, ProbeRequest, probe_ids, score_rows
from moe_rl.rl.resume import RunCheckpoint
from moe_rl.rollout import RolloutConfig, RolloutManager
from moe_rl.rollout.dump import Decode, run_decoder, trained_records
from moe_rl.rollout.eval_config import EvalConfig
from moe_rl.rollout.evaluation import EvalResult, Evaluator
from moe_rl.rollout.expert_load import MoELayers
from moe_rl.rollout.train_batch import BatchInfo, build_batch
from moe_rl.signals.judge import Judge
from moe_rl.signals.teacher import Teacher
from moe_rl.trace import TRACER


@dataclasses.dataclass(frozen=True)
class BatchRequest:
    """`RolloutWorker.get_batch`: the next batch, built as the trainer takes it."""

    n_groups: int
    version: int
    """The trainer version that consumes it (staleness is counted against it)."""
    algorithm: AlgorithmConfig
    """Advantages are computed with it."""
    row_multiple: int = 1
    """Rows are padded (loss mask 0) to a multiple of it (mini-batches x micro-batch x dp)."""
    dump: bool = False
    """`rollout.dump`: also return the samples' dump records (`moe_rl.rollout.dump.trained_records`)."""
    probe_samples: int = 0
    """The consistency probe's sequences to keep the ids of (`moe_rl.rl.consistency_probe.probe_ids`); 0: none."""


@dataclasses.dataclass
class TrainBatch:
    """What the driver receives for one batch: the tensors stay in Ray's object store."""

    tensors: ray.ObjectRef
    """The `build_batch` `RLBatch`, put by the rollout worker; pass it to `TrainerGroup.step`."""
    info: BatchInfo
    tensor_bytes: int
    """Bytes of the batch's tensors (`perf/batch_tensor_bytes`)."""
    records: list[dict[str, Any]] | None = None
    """The dump records of its samples at step version + 1 (`BatchRequest.dump`), else None."""
    probe_ids: list[list[int]] | None = None
    """The consistency probe's sequences (`BatchRequest.probe_samples`), else None."""

    def driver_bytes(self) -> int:
        """What the driver holds for the batch, pickled (`perf/driver_batch_bytes`): the metadata
        plus the ref's id (an ObjectRef travels as its id and its owner's address)."""
        metadata = dataclasses.replace(self, tensors=None)
        return len(pickle.dumps(metadata)) + len(self.tensors.binary())


class EngineServer:
    """One engine server process (a Ray actor); `restart` relaunches it after it died.

    kind "embedded": the CPU engine. kind "sglang": `sglang.launch_server` with `engines.tp/ep/dp`,
    on the GPUs Ray gave this actor (disaggregated: the actor holds `engines.tp` GPUs and Ray sets
    CUDA_VISIBLE_DEVICES), or, colocated, on the trainer's GPUs named by `gpu_ids` (the actor
    holds none itself; SGLang's memory saver lets the trainer have them while it trains).
    `cpus`: pin the embedded engine's process to these cores (`cpu_pools.engines[i]`), a thread each."""

    def __init__(
        self,
        model_dir: str,
        engines,
        log_path: str,
        weight_version: int = 0,
        gpu_ids: list[str] | None = None,
        lora=None,
        cpus: list[int] | None = None,
        delta: bool = False,
    ):
        self.model_dir, self.engines, self.log_path, self.gpu_ids = model_dir, engines, log_path, gpu_ids
        self.delta = delta  # `sync.delta`: SGLang loads updates with the delta loader
        self.lora = lora  # SGLangLoRA slots (the embedded engine always serves adapters)
        self.cpus = cpus
        self.weight_version = weight_version
        self.process = self._launch()

    def _launch(self):
        cfg = self.engines
        if cfg.kind == "embedded":
            return launch_embedded(
                EmbeddedConfig(
                    model_path=self.model_dir,
                    weight_version=str(self.weight_version),
                    max_batch=cfg.max_batch,
                    threads=len(self.cpus) if self.cpus else cfg.threads,
                    cpus=self.cpus,
                    speculative_steps=cfg.speculative.steps if cfg.speculative else 0,
                ),
                log_path=self.log_path,
            )

        config = engine_sglang_config(
            cfg,
            self.model_dir,
            host=ray.util.get_node_ip_address(),
            weight_version=str(self.weight_version),
            colocated=self.gpu_ids is not None,
            lora=self.lora,
            delta=self.delta,
        )
        env = None if self.gpu_ids is None else {"CUDA_VISIBLE_DEVICES": ",".join(self.gpu_ids)}
        return launch_sglang(config, log_path=self.log_path, env=env)

    def url(self) -> str:
        return self.process.url

    def pid(self) -> int:
        return self.process.process.pid

    def restart(self) -> str:
        """Stop what is left of the process, start a new one on the launch weights (serving
        `weight_version`: the sender catches it up before it gets work); returns its URL."""
        self.process.stop()
        self.process = self._launch()
        return self.process.url

    def adopt(self, model_dir: str, weight_version: int, groups: list[str]) -> str:
        """Kept across a trainer restart: the engine leaves the dead trainer's weight-update
        `groups` (SGLang keeps a name taken until then; one it is not in answers "does not exist"),
        and a later restart starts on `model_dir` (the resumed run checkpoint, serving
        `weight_version`); a process found dead is restarted on it now. Returns its URL."""
        self.model_dir, self.weight_version = model_dir, weight_version
        if self.process.process.poll() is not None:
            return self.restart()

        async def leave() -> None:
            client = EngineClient(self.process.url, kind=self.engines.kind)
            try:
                for group in groups:
                    with contextlib.suppress(EngineError):  # not in that group
                        await client.destroy_weights_update_group(group)
            finally:
                await client.close()

        asyncio.run(leave())
        return self.process.url

    def stop(self) -> None:
        self.process.stop()


def engine_placement(
    engines, colocate: bool, trainer_devices: list[tuple[str, list[str]]] | None = None
) -> list[tuple[dict, list[str] | None]]:
    """Ray actor options and colocated GPU ids of each engine server.

    Embedded: one CPU each. SGLang, disaggregated: `engines.tp` GPUs of its own. SGLang,
    colocated: engine i runs on the GPUs of trainer ranks [i * tp, (i + 1) * tp) (`trainer_devices`:
    each rank's (node, GPU ids)), in rank i * tp's placement-group bundle, holding no resources.
    """
    if engines.kind == "embedded":
        return [({"num_cpus": 1, "num_gpus": 0}, None)] * engines.count
    if not colocate:
        return [({"num_cpus": 1, "num_gpus": engines.tp}, None)] * engines.count
    placement = []
    for i in range(engines.count):
        ranks = trainer_devices[i * engines.tp : (i + 1) * engines.tp]
        nodes = {node for node, _ in ranks}
        if len(ranks) < engines.tp or len(nodes) != 1:
            raise ValueError(
                f"rl.colocate: engine {i} needs engines.tp={engines.tp} trainer GPUs on one node, but "
                f"trainer ranks {i * engines.tp}..{(i + 1) * engines.tp - 1} are on {sorted(nodes)}: "
                "make engines.tp divide the GPUs per node"
            )
        placement.append(
            ({"num_cpus": 0, "num_gpus": 0, "bundle": i * engines.tp}, [gpu for _, gpus in ranks for gpu in gpus])
        )
    return placement


class RolloutWorker:
    """The rollout manager as an async Ray actor."""

    def __init__(
        self,
        config: RolloutConfig,
        urls: list[str],
        kind: str,
        layers: int,
        topk: int,
        adapters: bool = False,
        cpus: list[int] | None = None,
        tokenizer_dir: str | None = None,
        evaluation: EvalConfig | None = None,
        num_experts: int | None = None,
        moe_layers: tuple[int, ...] = (),
        teacher_urls: dict[str | None, str] | None = None,
        judge_url: str | None = None,
    ):
        """`teacher_urls`: on-policy distillation's teachers by task name (None: the default one);
        `judge_url`: the served judge of `rollout.reward: judge`."""
        TRACER.process = "rollout worker"
        if cpus:  # `cpu_pools`: the engines' cores (building requests and scoring is generation's
            pin_process(cpus, batch=True)  # work), not taking them from an engine when it wakes
        self.config, self.urls, self.kind, self.layout = config, urls, kind, (layers, topk)
        self.adapters = adapters  # LoRA: requests name the newest adapter, `policy-v{version}`
        self.tokenizer_dir = tokenizer_dir  # text and chat prompts, agents
        self.manager = self.task = self.evaluator = None
        self.evaluation = evaluation
        self.eval_tasks: list[asyncio.Task] = []
        self.eval_results: list[EvalResult] = []
        self.num_experts = num_experts  # routed experts are stored narrow (`moe_rl.sample.routing_dtype`)
        # the expert load of each batch (`moe_rl.rollout.expert_load`), when samples carry routing
        self.moe = MoELayers(moe_layers, num_experts) if moe_layers and num_experts else None
        self.decode: Decode | None = None  # `rollout.dump` records, built on first use
        self.traced: list[EngineClient] = []  # engines recording spans (`start_trace`)
        self.active_total_s = self.active_mean_s = 0.0  # `_mean_active_s`
        self.teacher = Teacher(teacher_urls, kind) if teacher_urls else None
        self.judge = Judge(config.judge, judge_url, kind) if judge_url else None

    async def start(self, restore: RunCheckpoint | None = None) -> None:
        """Start generating; `restore`: the run checkpoint to continue from."""

        clients = [self._client(i, url) for i, url in enumerate(self.urls)]
        self.pool = EnginePool(clients)
        self.manager = RolloutManager(
            self.config,
            self.pool,
            tokenizer_dir=self.tokenizer_dir,
            version=restore.step if restore else 0,
            adapters=self.adapters,
            teacher=self.teacher,
            judge=self.judge,
        )
        if restore is not None:
            self.manager.restore(restore.rollout)
        self.task = asyncio.get_running_loop().create_task(self.manager.run())
        self.started = time.perf_counter()
        if self.evaluation is not None:
            self.evaluator = Evaluator(self.evaluation, self.config, self.pool, self.tokenizer_dir)
            self.eval_lock = asyncio.Lock()
            await self.evaluator.start()
        freeze_setup()  # the task, its data and the imports: out of the collector's full passes

    async def start_eval(self) -> None:
        """Queue an evaluation of the policy the engines serve when it begins; returns at once."""

        async def evaluate():
            async with self.eval_lock:
                self.eval_results += await self.evaluator.evaluate(self.manager.buffer.version)

        self.eval_tasks.append(asyncio.get_running_loop().create_task(evaluate()))

    async def finished_evals(self, wait: bool = False) -> tuple[list[EvalResult], int]:
        """The evaluations finished since the last call (`wait`: after every queued one ended) and
        how many are still running or queued; raises the error of one that failed."""
        if wait:
            await asyncio.gather(*self.eval_tasks)
        for task in [t for t in self.eval_tasks if t.done()]:
            self.eval_tasks.remove(task)
            task.result()
        results, self.eval_results = self.eval_results, []
        return results, len(self.eval_tasks)

    async def cpus(self) -> list[int]:
        """The cores this worker's process may run on."""
        return sorted(os.sched_getaffinity(0))

    async def snapshot(self) -> dict:
        """The manager's run-checkpoint state, between two steps (the driver waits for this call)."""
        return self.manager.snapshot()

    async def get_groups(self, n_groups: int, version: int) -> list:
        """The next groups within the staleness bound of trainer `version` (waits for them); raises
        if generation failed."""
        batch = asyncio.ensure_future(self.manager.buffer.get_batch(n_groups, version))
        await asyncio.wait({batch, self.task}, return_when=asyncio.FIRST_COMPLETED)
        if not batch.done():
            batch.cancel()
            self.task.result()  # raises generation's error
            raise RuntimeError("rollout manager stopped before the batch was complete")
        return batch.result()

    async def get_batch(self, request: BatchRequest) -> TrainBatch:
        """The next batch as the trainer takes it: its tensors put in Ray's object store (the
        driver gets their ref and the metadata, module docstring)."""
        groups = await self.get_groups(request.n_groups, request.version)
        if request.dump and self.decode is None:
            self.decode = run_decoder(self.config, self.tokenizer_dir)
        # a thread: building a large batch must not stall generation on this loop
        return await asyncio.to_thread(self._build, groups, request)

    def _build(self, groups: list, request: BatchRequest) -> TrainBatch:
        with TRACER.span("build batch", lane="batch build", version=request.version):
            moe = self.moe
            batch, info = build_batch(
                groups, request.algorithm, request.version, self.config.max_staleness, request.row_multiple, moe
            )
            records = None
            if request.dump:
                step, version = request.version + 1, request.version
                records = trained_records(step, groups, info, decode=self.decode, trainer_version=version, moe=moe)
            probe = probe_ids(batch, request.probe_samples) if request.probe_samples else None
            return TrainBatch(ray.put(batch), info, batch.tensor_bytes(), records, probe)

    async def score_probe(self, ids: list[list[int]], request: ProbeRequest) -> ProbeBatch | str:
        """The consistency probe's engine side (`moe_rl.rl.consistency_probe`): the batch's probe
        sequences (`TrainBatch.probe_ids`) scored as they are, beside the running rollout; the
        probe batch or why it is skipped."""
        return await score_rows(self.pool, ids, request)

    async def start_trace(self) -> None:
        """Record this worker's spans and every embedded engine's (`moe_rl.trace`)."""
        TRACER.start()
        self.traced = [c for c in self.pool.clients if c is not None and await c.start_trace()]

    async def stop_trace(self) -> list[dict]:
        """This worker's spans, then each traced engine's (an engine that died meanwhile is left out)."""
        self.pool.trace_in_flight()
        recorded = [TRACER.stop()]
        for client in self.traced:
            try:
                recorded.append(await client.stop_trace())
            except EngineError:
                continue
        return recorded

    async def engine_states(self) -> list[dict]:
        """Per engine slot: live (gets work), removed (no engine: taken out, or it never joined),
        requests in flight, requests served and the (lowest, highest) token version generated
        since it got work (`EnginePool.versions`)."""
        pool = self.pool
        return [
            {"live": live, "removed": client is None, "in_flight": n, "served": served, "versions": versions}
            for client, live, n, served, versions in zip(
                pool.clients, pool.live, pool.in_flight, pool.served, pool.versions
            )
        ]

    async def mark_dead(self, index: int) -> None:
        """Engine `index` died (the weight sender found it): no new work for it."""
        self.pool.mark_dead(index)

    async def revive(self, index: int, url: str) -> None:
        """Engine `index` was restarted at `url` and serves the current weights: give it work."""
        await self.pool.revive(index, self._client(index, url))

    async def add_engine(self, index: int, url: str) -> None:
        """A new engine `index` at `url` serves the current weights: give it work (`moe_rl.rl.fleet`)."""
        self.pool.add(index, self._client(index, url))

    async def remove_engine(self, index: int) -> int:
        """Take engine `index` out of the pool; returns once nothing runs on it (`EnginePool.remove`:
        its requests were aborted and continue on other engines). Returns how many were cut."""
        if self.traced and self.pool.clients[index] in self.traced:
            self.traced.remove(self.pool.clients[index])
        return await self.pool.remove(index)

    def _client(self, index: int, url: str) -> EngineClient:
        return EngineClient(
            url,
            kind=self.kind,
            name=engine_name(index),
            num_hidden_layers=self.layout[0],
            topk=self.layout[1],
            num_experts=self.num_experts,
        )

    async def admit(self, version: int) -> dict[str, float]:
        """The engines serve `version`: the rounds it allows may start (`RolloutBuffer.set_version`).
        Answers `metrics()` as read just before (one call: the driver reads the answer for the
        step's row while the next step trains)."""
        metrics = await self.metrics()
        await self.manager.buffer.set_version(version)
        return metrics

    async def drain(self) -> float:
        """Wait until no group is generating or being scored (drain-before-sync); seconds waited."""
        start = time.perf_counter()
        while self.manager.accounting()["open"] and not self.task.done():
            await asyncio.sleep(0.005)
        return time.perf_counter() - start

    async def metrics(self) -> dict[str, float]:
        return {
            **self.manager.metrics(),
            "rollout/generated_tokens": self.pool.generated_tokens,
            **{f"rollout/{name}": count for name, count in self.pool.spec.items()},
            "engines/resubmitted_requests": self.pool.resubmitted,
            "engines/live": sum(self.pool.live),
            "engines/added": self.pool.added,
            "engines/removed": self.pool.removed,
            "engines/cut_requests": self.pool.cut,
            "engines/active_s": self._mean_active_s(),
            "rollout/generated_tokens_per_s": self.pool.generated_tokens / (time.perf_counter() - self.started),
        }

    async def engines_active_s(self) -> float:
        """`engines/active_s` alone (`metrics` also takes the windowed counters, such as the agents')."""
        return self._mean_active_s()

    def _mean_active_s(self) -> float:
        """Cumulative active seconds of the mean engine: each call adds the busy seconds since the
        last one over the engines present now, so the count changing (`moe-rl engines`) does not
        move the past (a step's difference stays that step's busy time of the mean engine)."""
        total = sum(self.pool.active_seconds())
        present = sum(client is not None for client in self.pool.clients)
        self.active_mean_s += (total - self.active_total_s) / max(1, present)
        self.active_total_s = total
        return self.active_mean_s

    async def stop(self) -> dict:
        """Stop generating; queued groups are dropped ("unused"). Returns the ledger (None when
        `start` failed before the manager existed: its error is the one to report)."""
        if self.manager is None:
            return None
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        for task in self.eval_tasks:
            task.cancel()
        await asyncio.gather(*self.eval_tasks, return_exceptions=True)
        if self.evaluator is not None:
            await self.evaluator.close()
        buffer = self.manager.buffer
        for gid in sorted(buffer.queued_ids()):
            buffer.drop(gid, "unused")
        self.manager.close()
        # the engines may outlive this worker (kept through a trainer fault): none goes on with its requests
        clients = [client for client in self.pool.clients if client is not None]
        await asyncio.gather(*(client.abort_request() for client in clients), return_exceptions=True)
        await self.pool.close()
        for signal in (self.teacher, self.judge):
            if signal is not None:
                await signal.close()
        return {
            "accounting": self.manager.accounting(),
            "delivered": dict(buffer.delivered),
            "dropped": dict(buffer.dropped),
            "started": sorted(self.manager.started_ids),
        }
