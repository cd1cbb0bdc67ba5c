"""`RolloutManager`: generates scored groups into the `RolloutBuffer`, on one asyncio loop.

Rounds: round r is the batch the trainer consumes at version r (a run starts at the buffer's
version). The manager starts round r once the buffer admits it
(`RolloutBuffer.wait_to_start`, the staleness capacity rule), launches
ceil(oversample_factor * groups_per_step) groups for it, puts the first groups_per_step that
complete into the buffer and aborts the rest (counted `dropped_oversampled`). A group dropped
for zero reward variance is replaced by a fresh prompt in the same round. Several rounds run at
once, up to `max_staleness` ahead of the trainer.

A group = `n_samples_per_prompt` generations of one prompt through the `EnginePool` (which keeps
a group on one engine and sends samples started together as one batch request), each with
logprobs and routed experts, then the rewards, through a
`RewardScorer` (`moe_rl.rollout.scoring`: off the loop, time-limited; a reward that raises or
hangs scores 0, counted), or a served `Judge` (`rollout.reward: judge`, `moe_rl.signals.judge`);
with a distillation `Teacher` the group's tokens are scored beside its rewards
(`moe_rl.signals.teacher`). A mixture's group (`rollout.tasks`) is one task's prompt, and its
samples are decoded and scored by that entry's task and reward, counted under
`rollout/task/<name>/` (`moe_rl.tasks.mixture`). When the orchestrator pauses engines in abort mode for a weight swap,
in-flight requests return with finish reason "abort" and their partial tokens; the manager resubmits each
as prompt + partial response with the remaining budget (`moe_rl.rollout.partial`). In retract
and in-place modes the engine keeps the request and its per-token versions show the switch.
With adapters (LoRA), each request names the newest adapter `policy-v{version}` and keeps it to
its end (generation is never paused), so all its tokens carry that version.

Accounting: every group id the manager creates ends in exactly one of `buffer.delivered` or
`buffer.dropped` (reasons: zero_variance, oversampled, stale, stopped), or is still queued or
generating when the run stops; see `accounting()`.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import math
import time
from pathlib import Path

from moe_rl.agents import AgentFailure, AgentRunner
from moe_rl.engine.pool import EnginePool
from moe_rl.engine.sampling import SamplingParams
from moe_rl.rollout.buffer import Group, RolloutBuffer
from moe_rl.rollout.config import RolloutConfig
from moe_rl.rollout.partial import continuation_request, continue_sample, mask_older_tokens
from moe_rl.rollout.scoring import RewardScorer
from moe_rl.sample import Sample
from moe_rl.signals.judge import Judge
from moe_rl.signals.teacher import Teacher
from moe_rl.tasks import Prompt, Task, get_reward
from moe_rl.tasks.mixture import TASK_METRICS, TaskMixture
from moe_rl.tasks.registry import resolve_agent
from moe_rl.trace import TRACER
from sync.lora import adapter_name


class RolloutManager:
    def __init__(
        self,
        config: RolloutConfig,
        pool: EnginePool,
        *,
        task: Task | None = None,
        tokenizer_dir: str | Path | None = None,
        version: int = 0,
        adapters: bool = False,
        teacher: Teacher | None = None,
        judge: Judge | None = None,
    ):
        """`teacher`: on-policy distillation, scores every finished group's tokens (`moe_rl.signals.teacher`);
        `judge`: with `rollout.reward: judge`, gives the rewards (`moe_rl.signals.judge`)."""
        self.config, self.pool = config, pool
        self.teacher, self.judge = teacher, judge
        if (config.reward == "judge") != (judge is not None):
            raise ValueError("RolloutManager: pass judge=Judge(...) exactly when rollout.reward is 'judge'")
        self.adapters = adapters
        self.task = task = task or config.make_task(tokenizer_dir)
        self.scorers = self._scorers(task)
        self.drawn: collections.Counter[str | None] = collections.Counter()  # prompts drawn per task
        self.stop_token_ids = list(task.stop_token_ids)
        self.agents: AgentRunner | None = None
        agent = resolve_agent(config.agent) if config.agent is not None else task.agent
        if agent is not None:
            if tokenizer_dir is None:
                raise ValueError("rollout.agent needs the model's tokenizer: set model.tokenizer (or model.path)")
            self.agents = AgentRunner.for_agent(
                agent,
                tokenizer_dir,
                config.episode,
                max_new_tokens=config.max_new_tokens,
                score=self.scorers[None][1].score_blocking,  # one task (a mixture's are single-turn)
            )
            self.stop_token_ids.append(self.agents.chat.eos_id)
        self._replays: dict[str, list[list[dict]]] = {}  # restored open episodes: their finished turns
        self.buffer = RolloutBuffer(
            groups_per_step=config.groups_per_step,
            max_staleness=config.max_staleness,
            stale_policy=config.stale_policy,
            version=version,
            on_reject=self._replace,
        )
        self._prompts = task.prompts(config.seed)
        self._next_group = 0
        self._open: dict[asyncio.Task, str] = {}  # every running group task -> its group id
        self._fills: set[asyncio.Task] = set()  # replacements of stale groups
        self._inflight: dict[str, tuple[Prompt, list[Sample]]] = {}  # open group -> prompt, samples so far
        self.started_ids: set[str] = set()
        self.continued_requests = 0
        self.discarded_tokens = 0

    # -- the loop ----------------------------------------------------------------------------------

    async def run(self, num_rounds: int | None = None) -> None:
        """Generate rounds v, v+1, ... (v = the buffer's version; forever, or `num_rounds`) until
        cancelled. On the way out,
        every group still generating is aborted on its engine and counted `dropped_stopped`."""
        rounds = []
        if self.agents is not None:
            await self.agents.endpoint.start()
        try:
            first = r = self.buffer.version
            while num_rounds is None or r < first + num_rounds:
                await self._until(self.buffer.wait_to_start(r), rounds)
                rounds.append(asyncio.create_task(self._run_round(r)))
                r += 1
            await asyncio.gather(*rounds)
        finally:
            for task in rounds + list(self._fills):
                task.cancel()
            await asyncio.gather(*rounds, *self._fills, return_exceptions=True)
            await self._cancel(list(self._open), "stopped")
            if self.agents is not None:
                await self.agents.endpoint.stop()

    async def _until(self, waiting, rounds: list[asyncio.Task]) -> None:
        """Await `waiting`, but raise at once the error of a round or fill that failed meanwhile
        (e.g. an engine refusing every request): back-pressure would otherwise wait forever."""
        waiting = asyncio.ensure_future(waiting)
        try:
            while not waiting.done():
                watched = rounds + list(self._fills)
                for task in watched:
                    if task.done() and not task.cancelled() and task.exception() is not None:
                        raise task.exception()
                await asyncio.wait(
                    {waiting, *(t for t in watched if not t.done())}, return_when=asyncio.FIRST_COMPLETED
                )
        finally:
            waiting.cancel()

    def _scorers(self, task: Task) -> dict[str | None, tuple[Task, RewardScorer]]:
        """Who decodes and scores a sample, by its `metadata["task"]`: a mixture's entry (its own
        task, reward and counts under `rollout/task/<name>/`), else the one task (key None)."""
        cfg = self.config

        def scorer(fn, prefix: str) -> RewardScorer:
            return RewardScorer(fn, timeout_s=cfg.reward_timeout_s, workers=cfg.reward_workers, prefix=prefix)

        if isinstance(task, TaskMixture):
            return {name: (p.task, scorer(p.reward, f"{TASK_METRICS}/{name}")) for name, p in task.parts.items()}
        reward = task.reward if cfg.reward in (None, "judge") else get_reward(cfg.reward)  # a judge scores apart
        return {None: (task, scorer(reward, "rollout"))}

    def close(self) -> None:
        for _, scorer in self.scorers.values():
            scorer.close()
        if self.agents is not None:
            self.agents.close()

    async def _run_round(self, r: int) -> None:
        need = self.config.groups_per_step
        running: set[asyncio.Task] = set()
        for _ in range(math.ceil(self.config.oversample_factor * need)):
            running.add(self._launch(self._new_group(), r))
        accepted = 0
        try:
            while accepted < need:
                done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    group = task.result()
                    if group is None:  # dropped (zero variance): refill the round if it is short
                        if accepted + len(running) < need:
                            running.add(self._launch(self._new_group(), r))
                    elif accepted < need:
                        accepted += 1
                        await self.buffer.put(group)
                    else:
                        self.buffer.drop(group[0].group_id, "oversampled")
        finally:
            await self._cancel(running, "oversampled" if accepted >= need else "stopped")

    def _replace(self, group: Group) -> None:
        """Buffer callback for a group rejected as stale: regenerate it, or a fresh prompt."""
        gid = group[0].group_id
        requeue = gid not in self.buffer.dropped
        meta = group[0].metadata
        prompt = Prompt(
            prompt_ids=[] if meta.get("messages") else group[0].prompt_ids,
            answer=meta.get("answer"),
            metadata=meta.get("prompt", {}),
            messages=meta.get("messages"),
            tools=meta.get("tools"),
            task=meta.get("task"),
        )
        self._start_fill((gid, prompt) if requeue else self._new_group())

    def _start_fill(self, group: tuple[str, Prompt], samples: list[Sample] | None = None) -> None:
        task = asyncio.get_running_loop().create_task(self._fill(group, samples))
        self._fills.add(task)
        task.add_done_callback(self._forget_fill)

    def _forget_fill(self, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is None:  # a failed fill stays: `_until` raises it
            self._fills.discard(task)

    async def _fill(self, group: tuple[str, Prompt], samples: list[Sample] | None = None) -> None:
        """Generate one group outside any round (a stale group's replacement, or an open group of
        a run checkpoint, continued from `samples`); retry past filters."""
        while True:
            result = await self._launch(group, round_index=-1, samples=samples)
            if result is not None:
                await self.buffer.put(result)
                return
            group, samples = self._new_group(), None

    # -- one group ---------------------------------------------------------------------------------

    def _new_group(self) -> tuple[str, Prompt]:
        gid = f"g{self.config.seed}-{self._next_group}"
        self._next_group += 1
        return gid, self._draw()

    def _draw(self) -> Prompt:
        prompt = next(self._prompts)
        self.drawn[prompt.task] += 1
        return prompt

    def _launch(self, group: tuple[str, Prompt], round_index: int, samples: list[Sample] | None = None) -> asyncio.Task:
        gid, prompt = group
        self.started_ids.add(gid)
        if self.agents is not None:
            samples = []  # episodes keep their own state (`AgentRunner.open`)
        elif samples is None:
            samples = [
                Sample(
                    prompt_ids=list(prompt.prompt_ids),
                    group_id=gid,
                    metadata={
                        "answer": prompt.answer,
                        "prompt": prompt.metadata,
                        "round": round_index,
                        "task": prompt.task,
                    },
                )
                for _ in range(self.config.n_samples_per_prompt)
            ]
        self._inflight[gid] = (prompt, samples)
        task = asyncio.get_running_loop().create_task(self._generate_group(gid), name=gid)
        self._open[task] = gid

        def settled(t: asyncio.Task) -> None:
            self._open.pop(t, None)
            self._inflight.pop(gid, None)

        task.add_done_callback(settled)
        return task

    async def _cancel(self, tasks, reason: str) -> None:
        """Cancel group tasks; every group among them not yet settled is dropped for `reason`, also
        one whose task finished just before its round was cancelled (its result never taken)."""
        settled = self.buffer.settled_ids()
        for task in tasks:
            task.cancel()
            if task.get_name() not in settled:
                self.buffer.drop(task.get_name(), reason)
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _generate_group(self, gid: str) -> Group | None:
        start = time.time()  # the group's generate and reward spans (async: groups overlap on the loop)
        if self.agents is not None:
            group = await self._run_episodes(gid)
            TRACER.add("episodes", start, time.time(), lane="groups", group=gid)
            return group
        try:
            samples = await asyncio.gather(
                *[self._generate_sample(gid, i) for i in range(self.config.n_samples_per_prompt)]
            )
        finally:
            self.pool.release_group(gid)
        scored = time.time()
        TRACER.add("generate", start, scored, lane="groups", group=gid)
        task, scorer = self.scorers[samples[0].metadata.get("task")]
        if self.judge is not None:
            rewards = self.judge.score_group(
                [(task.decode(s.prompt_ids), task.decode(s.response_ids), s.metadata.get("answer")) for s in samples]
            )
        else:
            rewards = asyncio.gather(
                *[scorer.score(task.decode(s.response_ids), s.metadata.get("answer"), s) for s in samples]
            )
        rewards, _ = await asyncio.gather(rewards, self._teach(samples))  # the rewards and the teacher at once
        TRACER.add("reward", scored, time.time(), lane="groups", group=gid)
        for sample, reward in zip(samples, rewards):
            sample.reward = reward
        return self._filtered(gid, samples)

    def _filtered(self, gid: str, samples: list[Sample]) -> Group | None:
        if self.config.drop_zero_variance_groups and len({s.reward for s in samples}) == 1:
            self.buffer.drop(gid, "zero_variance")
            return None
        if self.config.mask_stale_tokens:
            samples = [mask_older_tokens(s) for s in samples]
        return samples

    async def _run_episodes(self, gid: str) -> Group | None:
        """The group's episodes through the agent (`moe_rl.agents.runner`); None when dropped."""
        prompt = self._inflight[gid][0]
        if not prompt.messages:
            raise ValueError(f"rollout.agent needs chat prompts: task {self.task.name!r} gave token ids only")

        async def turn(sample, env_ids, limit, sampling):
            return await self.generate_turn(gid, sample, env_ids, limit, sampling)

        try:
            samples = await self.agents.run_group(
                gid, prompt, self.config.n_samples_per_prompt, turn, self._replays.pop(gid, None)
            )
        except AgentFailure as failure:
            self.buffer.drop(gid, failure.reason)
            self.agents.check_alive(self.config.groups_per_step)
            return None
        finally:
            self.pool.release_group(gid)
        for sample in samples:
            sample.metadata.update(messages=prompt.messages, tools=prompt.tools, task=prompt.task)
        await self._teach(samples)
        return self._filtered(gid, samples)

    async def _teach(self, samples: list[Sample]) -> None:
        if self.teacher is not None:
            await self.teacher.score_group(samples)

    async def _generate_sample(self, gid: str, index: int) -> Sample:
        """Sample `index` of group `gid`, continued from its state in `_inflight` (which every
        returned segment updates, so a run checkpoint sees the tokens made so far)."""
        progress = self._inflight[gid][1]
        if is_finished(progress[index]):  # restored from a run checkpoint already complete
            return progress[index]

        def keep(sample: Sample) -> None:
            progress[index] = sample

        return await self.generate_turn(gid, progress[index], [], self.config.max_new_tokens, {}, keep)

    async def generate_turn(
        self, gid: str, sample: Sample, env_ids: list[int], limit: int, sampling: dict, keep=None
    ) -> Sample:
        """`sample` after `env_ids` and one engine turn that ends at stop or when the response
        reaches `limit` tokens; a request cut by an abort-mode weight swap continues under the new
        weights (or restarts the turn without `rollout.partial_rollout`). `sampling` overrides
        the rollout's sampling parameters; `keep(sample)` sees every returned segment."""
        cfg = self.config
        start, pending = sample, list(env_ids)
        params = {"stop_token_ids": self.stop_token_ids, **cfg.sampling(), **sampling}
        while True:
            input_ids, start_len = continuation_request(sample, pending)
            version = self.buffer.version  # LoRA: the newest adapter, loaded before the buffer heard of it
            result = await self.pool.generate(
                input_ids,
                SamplingParams(max_new_tokens=limit - len(sample.response_ids) - len(pending), **params),
                group_id=gid,
                return_logprob=True,
                return_routed_experts=cfg.return_routed_experts,
                routed_experts_start_len=start_len,
                lora_path=adapter_name(version) if self.adapters else None,
            )
            if self.adapters:  # the engine's base never changes: the adapter's version is the policy's
                result = dataclasses.replace(
                    result, weight_version=version, weight_versions=[version] * len(result.output_ids)
                )
            sample = continue_sample(sample, result, routed_experts=cfg.return_routed_experts, env_ids=pending)
            if result.output_ids:
                pending = []
            if keep is not None:
                keep(sample)
            if result.finish_reason != "abort" or len(sample.response_ids) >= limit:
                if sample.status == "aborted":  # the abort came exactly at the end of the budget
                    sample.status = "truncated"
                return sample
            self.continued_requests += 1
            if not cfg.partial_rollout:
                self.discarded_tokens += len(sample.response_ids) - len(start.response_ids)
                restarts = sample.restarts + 1
                if start.response_ids:  # a later turn of an episode: redo this turn
                    sample = dataclasses.replace(start, restarts=restarts)
                    pending = list(env_ids)
                else:
                    sample = Sample(
                        prompt_ids=sample.prompt_ids, group_id=gid, restarts=restarts, metadata=sample.metadata
                    )
                if keep is not None:
                    keep(sample)

    # -- run checkpoints -----------------------------------------------------------------------------

    def snapshot(self) -> dict:
        """JSON-safe state for a run checkpoint, taken between two trainer steps: the buffer
        (completed groups, ledger), the data position, and every group still generating with its
        samples as they stand: finished ones whole, partial ones with the tokens, logprobs,
        routing and versions of their returned segments (a segment still running is redone)."""
        settled = self.buffer.settled_ids()
        open_groups = [
            {
                "group_id": gid,
                "prompt": dataclasses.asdict(prompt),
                "samples": [s.to_dict() for s in samples],
                "episodes": self.agents.snapshot(gid) if self.agents is not None else [],
            }
            for gid, (prompt, samples) in sorted(self._inflight.items())
            if gid not in settled
        ]
        return {
            "buffer": self.buffer.snapshot(),
            "open": open_groups,
            "next_group": self._next_group,
            "started": sorted(self.started_ids),
            "mixture": self.config.mixture_signature(),  # checked on resume (`moe_rl.rl.resume`)
        }

    def restore(self, state: dict) -> None:
        """Continue from `snapshot()`'s state; call on the manager's loop before `run()`. Open
        groups go on from their partial samples (outside rounds, like a stale group's replacement)."""
        self.buffer.restore(state["buffer"])
        self.started_ids.update(state["started"])
        for _ in range(state["next_group"]):  # the data position (and the draws per task)
            self._draw()
        self._next_group = state["next_group"]
        for group in state["open"]:
            samples = [Sample.from_dict(s) for s in group["samples"]]
            if group.get("episodes"):  # agents re-run; their finished turns replay from the record
                self._replays[group["group_id"]] = group["episodes"]
            self._start_fill((group["group_id"], Prompt(**group["prompt"])), samples)

    # -- reporting ---------------------------------------------------------------------------------

    def accounting(self) -> dict[str, int]:
        """Group ids: started = delivered + dropped (by reason) + queued (in the buffer) + open."""
        settled = self.buffer.settled_ids()
        return {
            "started": len(self.started_ids),
            "queued": len(self.buffer),
            "open": len(self.started_ids - settled),
            **self.buffer.accounting(),
        }

    def metrics(self) -> dict[str, float]:
        scorers = [scorer for _, scorer in self.scorers.values()]
        per_task = {f"{TASK_METRICS}/{name}/prompts_drawn": n for name, n in self.drawn.items() if name is not None}
        for scorer in scorers:
            per_task.update(scorer.metrics())
        return {
            **(self.agents.metrics() if self.agents is not None else {}),
            **self.buffer.metrics(),
            **per_task,
            "rollout/reward_errors": sum(scorer.errors for scorer in scorers),
            "rollout/reward_timeouts": sum(scorer.timeouts for scorer in scorers),
            **(self.judge.metrics() if self.judge is not None else {}),
            "rollout/continued_requests": self.continued_requests,
            "rollout/discarded_tokens": self.discarded_tokens,
            "rollout/groups_started": len(self.started_ids),
        }


def is_finished(sample: Sample) -> bool:
    """True once the engine ended the sample (stop or budget), false while it is empty or cut."""
    return sample.segments > 0 and sample.status != "aborted"
