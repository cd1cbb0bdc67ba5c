"""Sampling for the embedded engine: one batched draw for every row of a forward.

Each row samples from the raw log-softmax of its request (temperature, then top-k, then top-p,
SGLang's order; a temperature below `SAMPLING_EPS` is greedy). The draw is by inverse CDF with one
uniform number per row from the row's own generator (`Request.rng`, seeded by `sampling_seed`), so a
seeded request draws the same tokens whatever else shares its batch. Batched because a per-row
draw (a `torch.multinomial` per request) cost as much CPU as the decode forward itself, on the
core the engine shares with nothing else (docs/rl.md, the step timeline).
"""

from __future__ import annotations

import torch

from moe_rl.engine.sampling import SamplingParams

SAMPLING_EPS = 1e-6
"""A temperature below this samples greedily (SGLang's `_SAMPLING_EPS`: dividing by it would overflow)."""


def sample_tokens(
    logprobs: torch.Tensor, params: list[SamplingParams], uniforms: list[float]
) -> tuple[list[int], list[bool]]:
    """The next token of each row of `logprobs` [rows, V] under its row's `params`, drawn with its
    `uniforms` value in (0, 1]; and, per row, whether the draw was valid (False where the row's
    scores hold no finite probability mass, e.g. NaN logits: that request fails, no other)."""
    probs = probabilities(logprobs, params)
    total = probs.sum(-1)
    greedy = torch.tensor([p.temperature < SAMPLING_EPS for p in params])
    valid = greedy | (torch.isfinite(total) & (total > 0))
    return draw(probs, torch.tensor(uniforms, dtype=probs.dtype)).tolist(), valid.tolist()


def probabilities(logprobs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row of `logprobs` [rows, V] samples from under its row's `params`
    (temperature, top-k, top-p; unnormalized after top-p); a greedy row is one-hot on its argmax.
    Speculative decoding applies the acceptance rule to these (`speculative.accept`)."""
    rows, vocab = logprobs.shape
    temperature = torch.tensor([p.temperature for p in params], dtype=logprobs.dtype)
    greedy = temperature < SAMPLING_EPS
    scores = logprobs / temperature.clamp_min(SAMPLING_EPS)[:, None]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params])
    if bool((top_k < vocab).any()):  # keep each row's k best (ties with the k-th kept)
        kth = scores.topk(int(top_k.max()), dim=-1).values.gather(1, (top_k - 1)[:, None])
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype)
    if bool((top_p < 1.0).any()):  # keep the smallest set of most likely tokens reaching top_p
        ordered, order = probs.sort(dim=-1, descending=True)
        outside = ordered.cumsum(-1) - ordered > top_p[:, None]
        probs = torch.zeros_like(probs).scatter(1, order, ordered.masked_fill(outside, 0.0))
    if bool(greedy.any()):
        onehot = torch.zeros_like(probs).scatter(1, logprobs.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], onehot, probs)
    return probs


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw from each row of `probs` [rows, V] (unnormalized) with `uniforms` [rows] in
    (0, 1]: the first token whose cumulative mass reaches u * total (u > 0: it has mass of its own)."""
    cdf = probs.cumsum(-1)
    threshold = uniforms.to(cdf.dtype) * cdf[:, -1]
    return (cdf < threshold[:, None]).sum(-1).clamp_max(probs.shape[-1] - 1)
