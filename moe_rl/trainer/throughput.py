"""The trainer's throughput on long-tailed RL batches: what `moe-rl bench train` measures.

RL responses are long-tailed, so a batch padded to its longest row computes mostly padding. For
one length distribution (`LengthSpec`, e.g. lognormal with a median and a cap, as DAPO-like
responses are) synthetic rollout samples are made into one trainer batch by `build_batch`, as
the rollout worker does, then each batching path trains on it in a fresh
trainer world of its own, one after the other in the same call: `padded` (micro-batches of
`micro_batch_size` rows at the batch's width) and `dynamic` (`trainer.max_tokens_per_microbatch`:
rows balanced over DP ranks, packed under the budget, each micro-batch padded to its own longest
row). Per path: `step_s` (median of the timed PPO steps), `real_tokens_per_s` (the rows' model
inputs per second), `padding_fraction` (1 - real / computed model inputs, computed from the
micro-batch plan each rank runs) and `peak_memory_bytes` (the largest rank's peak RSS).
"""

from __future__ import annotations

import dataclasses
import math
import resource
import statistics
import time

import torch

from moe_rl.rollout.train_batch import RLBatch
from moe_rl.sample import Sample, routing_dtype
from moe_rl.trainer.microbatches import Batch, budget_plan, padded_length, row_lengths

GROUP = 8
"""Samples per prompt (one GRPO group) of the synthetic batch."""


@dataclasses.dataclass(frozen=True)
class LengthSpec:
    """Rows of a synthetic RL batch: a prompt of `prompt` tokens plus a response whose length is
    lognormal around `median` (sigma `sigma`), at least 1 and at most `cap` tokens."""

    rows: int = 512
    prompt: int = 16
    median: int = 48
    cap: int = 384
    sigma: float = 1.0
    seed: int = 0

    @classmethod
    def parse(cls, text: str) -> "LengthSpec":
        """`rows=512,prompt=16,median=48,cap=384,sigma=1.0,seed=0` (any subset; the rest default)."""
        fields = {f.name: f.type for f in dataclasses.fields(cls)}
        values = {}
        for part in filter(None, text.split(",")):
            key, sep, value = part.partition("=")
            if not sep or key.strip() not in fields:
                raise ValueError(f"--lengths {text!r}: write key=value pairs among {sorted(fields)}")
            kind = float if key.strip() == "sigma" else int
            try:
                values[key.strip()] = kind(value)
            except ValueError:
                raise ValueError(f"--lengths {text!r}: {key}={value!r} is not a number") from None
        spec = cls(**values)
        if min(spec.rows, spec.prompt, spec.median, spec.cap) < 1 or spec.median > spec.cap:
            raise ValueError(f"--lengths {text!r}: rows, prompt, median, cap >= 1 and median <= cap")
        return spec

    def response_lengths(self) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed)
        normal = torch.randn(self.rows, generator=generator, dtype=torch.float64)
        lengths = torch.exp(math.log(self.median) + self.sigma * normal).round().clamp(1, self.cap)
        return [int(n) for n in lengths]


def synthetic_groups(spec: LengthSpec, vocab_size: int, routing: tuple[int, int, int] | None = None) -> list:
    """`spec.rows` rollout samples in GRPO groups of `GROUP` (as the rollout worker delivers them):
    random tokens, rewards and rollout logprobs, version 0; `routing`: (layers, topk, experts) for
    routed experts (R3), stored as `moe_rl.sample.routing_dtype` says. `rollout.train_batch.
    build_batch` makes the trainer batch of them."""
    generator = torch.Generator().manual_seed(spec.seed + 1)
    samples = []
    for index, response in enumerate(spec.response_lengths()):
        ids = torch.randint(1, vocab_size, (spec.prompt + response,), generator=generator).tolist()
        routed = None
        if routing is not None:
            layers, topk, experts = routing
            scores = torch.rand(len(ids) - 1, layers, experts, generator=generator)
            routed = scores.topk(topk, dim=-1).indices.numpy().astype(routing_dtype(experts))
        samples.append(
            Sample(
                prompt_ids=ids[: spec.prompt],
                response_ids=ids[spec.prompt :],
                rollout_logprobs=(-math.log(vocab_size) + 0.01 * torch.randn(response, generator=generator)).tolist(),
                loss_mask=[1] * response,
                weight_versions=[0] * response,
                routed_experts=routed,
                reward=float(torch.rand((), generator=generator)),
                group_id=f"g{index // GROUP}",
            )
        )
    return [samples[i : i + GROUP] for i in range(0, len(samples), GROUP)]


def computed_inputs(
    batch: Batch, dp_size: int, micro_batch_size: int, budget: int | None, multiple: int, packed: bool = False
) -> int:
    """Model inputs (tokens fed to the model, padding included) one step computes on all ranks:
    rows x width per micro-batch; `packed`: each micro-batch's rows' real inputs, padded to the
    sequence-parallel multiple (`microbatches.pack_microbatch`)."""
    rows, width = batch["tokens"].shape
    if budget is None:
        return rows * (padded_length(width, multiple) - 1)
    lengths = row_lengths(batch)
    total = 0
    for rank in budget_plan(lengths, dp_size, budget, multiple):
        for group in rank:
            if packed:
                real = sum(lengths[r] - 1 for r in group) or 1  # a padding micro-batch: one input
                total += real + (-real) % multiple
                continue
            group_width = padded_length(max(lengths[r] for r in group), multiple) if group else 1 + multiple
            total += max(len(group), 1) * (group_width - 1)
    return total


def measure(trainer_config, hf_config, batch: RLBatch, algorithm, steps: int) -> dict[str, float]:
    """Rank function (every rank of a trainer world): one warm-up RL train step, then `steps`
    timed ones on `batch`; returns this rank's median step seconds and peak RSS."""
    # heavy: megatron-core, only in the trainer world's ranks
    from moe_rl.algorithms import make_policy_loss
    from moe_rl.trainer.megatron_trainer import MegatronTrainer

    trainer = MegatronTrainer(trainer_config, hf_config)
    tensors = dataclasses.replace(batch, old_logprobs=batch.rollout_logprobs.clone()).tensors()
    loss = make_policy_loss(algorithm)
    times = []
    for step in range(steps + 1):
        start = time.perf_counter()
        trainer.train_step(tensors, loss, algorithm.num_mini_batches)
        if step:  # the first step warms up allocators and megatron-core's buffers
            times.append(time.perf_counter() - start)
    return {
        "step_s": statistics.median(times),
        "peak_memory_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
