"""Partial rollouts: turn engine results into `Sample`s and continue samples cut by a pause.

A request cut by an abort-mode pause returns finish reason "abort" with the tokens it made so
far. It is continued by generating again from prompt + partial response with the remaining budget
and `routed_experts_start_len = prompt_len + partial_len - 1`, so the engine returns routing only
for the positions the partial sample lacks. `continue_sample` concatenates the two exactly:
tokens, logprobs, loss mask and per-token versions append; routed-expert rows append (the
partial's rows cover positions [0, P + n - 1), the continuation's [P + n - 1, P + n + m - 1)).
`Sample.segments` counts the engine requests behind a sample, `Sample.request_ids` names them.

Episodes (`moe_rl.agents.episode`) use the same two calls with environment ids: the request is
the record + the new environment ids, and the result appends those ids (loss mask 0, logprob 0.0,
version None) before the sampled ones; the engine's rows then cover the environment tokens too.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moe_rl.engine.client import GenerateResult
from moe_rl.sample import Sample

STATUS_OF_FINISH = {"stop": "completed", "length": "truncated", "abort": "aborted"}


def continuation_request(sample: Sample, env_ids: list[int] = ()) -> tuple[list[int], int]:
    """(input ids, routed_experts_start_len) that continue `sample` (after `env_ids`) on an engine."""
    generated = len(sample.response_ids)
    start = len(sample.prompt_ids) + generated - 1 if generated else 0
    return sample.prompt_ids + sample.response_ids + list(env_ids), start


def continue_sample(
    partial: Sample, result: GenerateResult, *, routed_experts: bool, env_ids: list[int] = ()
) -> Sample:
    """`partial` extended by `env_ids` and `result`, the engine's answer to
    `continuation_request(partial, env_ids)`; `routed_experts`: whether the request asked for
    them (`return_routed_experts`). A result with no tokens appends nothing, `env_ids` included.

    A partial with no response yet takes the result as its first segment. With `routed_experts`,
    every segment that made tokens must bring exactly the rows its tokens need, so a sample's
    routing always covers every position: a segment with tokens but no routed experts, or the
    wrong number of rows, raises ValueError naming the sample and the segment. A segment with no
    tokens (SGLang answers a request aborted while still queued without `routed_experts`) adds no
    rows: the next continuation asks for the same ones again.
    """
    n_new = len(result.output_ids)
    logprobs = result.logprobs if result.logprobs is not None else [0.0] * n_new
    if len(logprobs) != n_new or len(result.weight_versions) != n_new:
        raise ValueError(
            f"engine result {result.rid}: {n_new} tokens but {len(logprobs)} logprobs and "
            f"{len(result.weight_versions)} versions"
        )
    routed = partial.routed_experts
    if routed_experts and n_new:
        segment = f"sample of group {partial.group_id!r}, segment {partial.segments + 1} (engine request {result.rid})"
        _, start = continuation_request(partial)
        expected = len(partial.prompt_ids) + len(partial.response_ids) + len(env_ids) + n_new - 1 - start
        if routed is None and partial.response_ids:
            raise ValueError(
                f"{segment}: the earlier segments' {len(partial.response_ids)} tokens have no routed "
                "experts, the sample's routing would miss their rows"
            )
        if result.routed_experts is None:
            raise ValueError(
                f"{segment}: {n_new} tokens but no routed_experts (expected {expected} rows); "
                "was the engine launched with --enable-return-routed-experts?"
            )
        if result.routed_experts.shape[0] != expected:
            raise ValueError(
                f"{segment}: routed_experts has {result.routed_experts.shape[0]} rows, expected {expected} "
                f"(prompt + partial + new - 1 - routed_experts_start_len={start}); does the engine honour "
                "routed_experts_start_len?"
            )
        routed = result.routed_experts if routed is None else np.concatenate([routed, result.routed_experts])
    env = list(env_ids) if n_new else []
    return dataclasses.replace(
        partial,
        response_ids=partial.response_ids + env + list(result.output_ids),
        rollout_logprobs=partial.rollout_logprobs + [0.0] * len(env) + list(logprobs),
        loss_mask=partial.loss_mask + [0] * len(env) + [1] * n_new,
        weight_versions=partial.weight_versions + [None] * len(env) + list(result.weight_versions),
        routed_experts=routed,
        status=STATUS_OF_FINISH.get(result.finish_reason, "aborted"),
        segments=partial.segments + 1,
        request_ids=[*partial.request_ids, result.rid],
    )


def mask_older_tokens(sample: Sample) -> Sample:
    """loss_mask 0 on tokens whose weight version is older than the sample's newest one."""
    versions = sample.model_versions()
    if not versions:
        return sample
    newest = max(versions)
    mask = [m if v == newest else 0 for m, v in zip(sample.loss_mask, sample.weight_versions)]
    return dataclasses.replace(sample, loss_mask=mask)
