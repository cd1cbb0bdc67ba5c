"""`Evaluator`: held-out evaluation on the rollout engines, each sample at one weight version.

An evaluation of version v generates `n_samples_per_prompt` samples of every prompt of every
eval dataset through the same `EnginePool` as training rollouts (in the async modes, next to
generation: the trainer never waits for it), scores them with the dataset's reward
(`RewardScorer`: a reward that raises or hangs scores 0, counted) and returns per dataset its
metrics and its samples.

One version per sample: a request cut by an abort-mode weight swap, or a sample whose tokens
span two versions (retract and in-place pauses; an episode whose turns straddle a sync), is
restarted whole under the weights then served, counted `eval/<name>/restarts`; its partial
tokens are discarded. So in the async modes an evaluation started at v may finish some samples
at a later version: its row is logged at the oldest version among its samples (v unless every
sample was restarted), names both ends (`weight_version_min`, `weight_version_max`) and every
dumped sample carries its own. In `rl.mode: sync` the driver waits for the evaluation before the
next sync, so every sample is at v.

Metrics per dataset (prefix `eval/<name>/`): `reward_mean`; `pass@k` for k = 1, 2, 4, ... and n,
the unbiased estimator of Chen et al. (2021) over the n samples of each prompt (a sample passes
when its reward >= `pass_threshold`), averaged over prompts; `mean@n` (the mean reward of a
prompt's n samples, averaged over prompts); `response_length_mean`, `truncation_rate`;
`seconds` (wall time of the evaluation) and `restarts`; the reward's errors and timeouts; for
agent datasets `episodes`, `turns_per_episode` and `tool_calls_per_episode`. With a mixture
(`rollout.tasks`), a dataset named like an entry evaluates that task (`EvalDatasetConfig.name`):
its metrics are that task's, and its samples and dump records carry the task's name.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import time
from typing import Any

from moe_rl.agents import AgentRunner
from moe_rl.engine.pool import EnginePool
from moe_rl.engine.sampling import SamplingParams
from moe_rl.rollout.config import RolloutConfig
from moe_rl.rollout.dump import sample_record, text_decoder
from moe_rl.rollout.eval_config import EvalConfig, EvalDatasetConfig
from moe_rl.rollout.partial import continuation_request, continue_sample
from moe_rl.rollout.scoring import RewardScorer
from moe_rl.sample import Sample
from moe_rl.tasks import Prompt, get_reward
from moe_rl.tasks.registry import resolve_agent


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c passed: 1 - C(n - c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def ks_of(n: int) -> list[int]:
    """The k reported for n samples per prompt: powers of two below n, and n."""
    return sorted({2**i for i in range(n.bit_length()) if 2**i < n} | {n})


@dataclasses.dataclass
class EvalResult:
    """One dataset's evaluation of one version: its metrics row and its samples as dump records."""

    name: str
    step: int
    metrics: dict[str, float]
    records: list[dict]


class CutByWeightUpdate(Exception):
    """An eval sample lost its single weight version: it is restarted whole."""


class EvalDataset:
    """One resolved eval dataset: its prompts, reward and (for agents) runner."""

    def __init__(self, config: EvalDatasetConfig, rollout: RolloutConfig, tokenizer_dir: str | None):
        self.task_name = config.name if config.mixture_entry(rollout) else None  # `sample.metadata["task"]`
        self.config = config = config.resolved(rollout)
        self.task = config.make_task(tokenizer_dir)
        count = len(self.task) if config.path is not None else config.num_prompts
        if config.num_prompts is not None:
            count = min(count, config.num_prompts)
        self.prompts: list[Prompt] = list(itertools.islice(self.task.prompts(config.seed), count))
        reward = get_reward(config.reward) if config.reward else self.task.reward
        self.scorer = RewardScorer(
            reward, timeout_s=rollout.reward_timeout_s, workers=rollout.reward_workers, prefix=f"eval/{config.name}"
        )
        self.stop_token_ids = list(self.task.stop_token_ids)
        self.decode = text_decoder(tokenizer_dir, lambda: self.task.decode)  # the dumps' text
        self.agents: AgentRunner | None = None
        agent = resolve_agent(config.agent) if config.agent is not None else self.task.agent
        if agent is not None:
            self.agents = AgentRunner.for_agent(
                agent,
                tokenizer_dir,
                rollout.episode,
                max_new_tokens=config.max_new_tokens,
                score=self.scorer.score_blocking,
            )
            self.stop_token_ids.append(self.agents.chat.eos_id)


class Evaluator:
    def __init__(self, config: EvalConfig, rollout: RolloutConfig, pool: EnginePool, tokenizer_dir: str | None = None):
        self.pool = pool
        self.datasets = [EvalDataset(d, rollout, tokenizer_dir) for d in config.datasets]
        self.restarts = 0

    async def start(self) -> None:
        for dataset in self.datasets:
            if dataset.agents is not None:
                await dataset.agents.endpoint.start()

    async def close(self) -> None:
        for dataset in self.datasets:
            dataset.scorer.close()
            if dataset.agents is not None:
                await dataset.agents.endpoint.stop()
                dataset.agents.close()

    async def evaluate(self, step: int) -> list[EvalResult]:
        """Every dataset's evaluation of the policy the engines serve (trainer version `step`)."""
        return list(await asyncio.gather(*(self._dataset(d, step) for d in self.datasets)))

    async def _dataset(self, dataset: EvalDataset, step: int) -> EvalResult:
        cfg, start = dataset.config, time.perf_counter()
        restarts_before = self.restarts
        groups = await asyncio.gather(
            *(self._group(dataset, f"eval-{cfg.name}-{step}-{i}", p) for i, p in enumerate(dataset.prompts))
        )
        rewards = [_outcomes(group) for group in groups]
        samples = [s for group in groups for s in group]
        versions = [v for s in samples for v in s.weight_versions if v is not None]
        n, prefix = cfg.n_samples_per_prompt, f"eval/{cfg.name}"
        metrics = {
            f"{prefix}/reward_mean": _mean([r for group in rewards for r in group]),
            f"{prefix}/mean@{n}": _mean([_mean(group) for group in rewards]),
            f"{prefix}/response_length_mean": _mean([len(s.response_ids) for s in samples]),
            f"{prefix}/truncation_rate": _mean([s.status == "truncated" for s in samples]),
            f"{prefix}/prompts": len(groups),
            f"{prefix}/seconds": time.perf_counter() - start,
            f"{prefix}/restarts": self.restarts - restarts_before,
            f"{prefix}/weight_version_min": min(versions, default=step),
            f"{prefix}/weight_version_max": max(versions, default=step),
            **dataset.scorer.metrics(),
        }
        for k in ks_of(n):
            passed = [sum(r >= cfg.pass_threshold for r in group) for group in rewards]
            metrics[f"{prefix}/pass@{k}"] = _mean([pass_at_k(len(g), c, k) for g, c in zip(rewards, passed)])
        if dataset.agents is not None:
            metrics.update(_agent_metrics(dataset.agents, prefix))
        records = [
            sample_record(s, decode=dataset.decode, advantage=None, trainer_version=step, eval=cfg.name)
            for s in samples
        ]
        return EvalResult(cfg.name, min(versions, default=step), metrics, records)

    async def _group(self, dataset: EvalDataset, gid: str, prompt: Prompt) -> list[Sample]:
        """The n scored samples (or episodes) of one prompt, each at one weight version."""
        try:
            if dataset.agents is not None:
                return await self._episodes(dataset, gid, prompt)
            samples = await asyncio.gather(
                *(self._sample(dataset, gid, prompt) for _ in range(dataset.config.n_samples_per_prompt))
            )
        finally:
            self.pool.release_group(gid)
        for sample in samples:
            text = dataset.task.decode(sample.response_ids)
            sample.reward = await dataset.scorer.score(text, prompt.answer, sample)
        return list(samples)

    async def _sample(self, dataset: EvalDataset, gid: str, prompt: Prompt) -> Sample:
        meta = {"answer": prompt.answer, "task": dataset.task_name}
        fresh = Sample(prompt_ids=list(prompt.prompt_ids), group_id=gid, metadata=meta)
        while True:
            try:
                return await self._turn(dataset, gid, fresh, [], dataset.config.max_new_tokens, {})
            except CutByWeightUpdate:
                self.restarts += 1

    async def _episodes(self, dataset: EvalDataset, gid: str, prompt: Prompt) -> list[Sample]:
        """The prompt's episodes; a group with an episode cut by a weight update runs again whole."""

        async def turn(sample, env_ids, limit, sampling):
            return await self._turn(dataset, gid, sample, env_ids, limit, sampling)

        while True:
            try:
                return await dataset.agents.run_group(gid, prompt, dataset.config.n_samples_per_prompt, turn)
            except CutByWeightUpdate:
                self.restarts += 1

    async def _turn(
        self, dataset: EvalDataset, gid: str, sample: Sample, env_ids: list[int], limit: int, sampling: dict
    ) -> Sample:
        """`sample` after `env_ids` and one engine turn; CutByWeightUpdate when the turn was cut
        by a weight swap or its tokens are not all of one version."""
        input_ids, _ = continuation_request(sample, env_ids)
        params: dict[str, Any] = {"stop_token_ids": dataset.stop_token_ids, **dataset.config.sampling(), **sampling}
        result = await self.pool.generate(
            input_ids,
            SamplingParams(max_new_tokens=limit - len(sample.response_ids) - len(env_ids), **params),
            group_id=gid,
            return_logprob=False,
            return_routed_experts=False,
        )
        if result.finish_reason == "abort":
            raise CutByWeightUpdate
        sample = continue_sample(sample, result, routed_experts=False, env_ids=env_ids)
        if len({v for v in sample.weight_versions if v is not None}) > 1:
            raise CutByWeightUpdate
        return sample


def _outcomes(group: list[Sample]) -> list[float]:
    """The rewards pass@k counts: one per sample, or one per episode (an episode that forked into
    several sequences brings one sample per sequence, all with the episode's reward)."""
    episodes = {s.metadata["episode"]: s.reward for s in group if "episode" in s.metadata}
    return list(episodes.values()) if episodes else [s.reward for s in group]


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def _agent_metrics(agents: AgentRunner, prefix: str) -> dict[str, float]:
    window = agents.metrics()  # the episodes since the previous evaluation of this dataset
    keys = {"agents/episodes": "episodes", "agents/turns_per_episode": "turns_per_episode"}
    keys["agents/tool_calls_per_episode"] = "tool_calls_per_episode"
    keys.update({key: key.removeprefix("agents/") for key in window if key.startswith("agents/metric/")})
    return {f"{prefix}/{name}": window[key] for key, name in keys.items() if key in window}
