"""The embedded engine's batched sampler (`moe_rl.engine.embedded.sampler`): greedy and top-k 1 are
the argmax, top-k and top-p never draw outside their sets, a seeded request draws the same tokens
whatever shares its batch, the draws follow the softmax, and a row without probability mass fails
alone."""

from __future__ import annotations

import math
import random

import torch

from moe_rl.engine.embedded.request import Request
from moe_rl.engine.embedded.sampler import sample_tokens
from moe_rl.engine.sampling import SamplingParams


def draw(logprobs: torch.Tensor, params: list[SamplingParams], rng: random.Random) -> list[int]:
    tokens, valid = sample_tokens(logprobs, params, [1.0 - rng.random() for _ in params])
    assert all(valid)
    return tokens


def test_greedy_top_k_and_top_p_stay_in_their_sets():
    torch.manual_seed(0)
    logprobs = torch.log_softmax(torch.randn(6, 50), dim=-1)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=1),
        SamplingParams(top_k=5),
        SamplingParams(top_p=0.3),
        SamplingParams(temperature=0.7, top_k=8, top_p=0.5),
        SamplingParams(),
    ]
    best = logprobs.argmax(-1)
    top5 = logprobs[2].topk(5).indices.tolist()
    probs = logprobs[3].exp()
    order = probs.argsort(descending=True)
    nucleus = order[: int((probs[order].cumsum(0) < 0.3).sum()) + 1].tolist()  # smallest set reaching 0.3
    mixed = torch.softmax(logprobs[4] / 0.7, -1)
    mixed_top = mixed.topk(8)
    kept = mixed_top.values / mixed_top.values.sum()
    mixed_set = mixed_top.indices[: int((kept.cumsum(0) < 0.5).sum()) + 1].tolist()
    rng = random.Random(1)
    for _ in range(300):
        tokens = draw(logprobs, params, rng)
        assert tokens[0] == best[0] and tokens[1] == best[1]
        assert tokens[2] in top5 and tokens[3] in nucleus and tokens[4] in mixed_set
        assert 0 <= tokens[5] < 50


def test_a_seeded_request_draws_the_same_tokens_in_any_batch():
    torch.manual_seed(1)
    rows = torch.log_softmax(torch.randn(5, 64), dim=-1)
    seeded = SamplingParams(sampling_seed=7, top_p=0.9)

    def tokens_of_the_seeded(batchmates: int, row: int) -> list[int]:
        mine = Request(rid="a", input_ids=[1], params=seeded, eos_token_ids=frozenset())
        others = [
            Request(rid=str(i), input_ids=[1], params=SamplingParams(temperature=1.3), eos_token_ids=frozenset())
            for i in range(batchmates)
        ]
        batch = others[:row] + [mine] + others[row:]
        out = []
        for _ in range(20):
            params, uniforms = [r.params for r in batch], [r.uniform() for r in batch]
            tokens, _ = sample_tokens(rows[: len(batch)].roll(row, 0), params, uniforms)
            out.append(tokens[row])
        return out

    alone = tokens_of_the_seeded(0, 0)
    assert tokens_of_the_seeded(4, 2) == alone and tokens_of_the_seeded(3, 3) == alone


def test_draws_follow_the_softmax():
    """n draws of a 4-token distribution: each token's count lies within 5 standard deviations of
    n p (a false alarm has probability ~6e-7 per token)."""
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 20_000
    logprobs = p.log().expand(n, 4).contiguous()
    rng = random.Random(3)
    tokens, valid = sample_tokens(logprobs, [SamplingParams()] * n, [1.0 - rng.random() for _ in range(n)])
    assert all(valid)
    counts = torch.bincount(torch.tensor(tokens), minlength=4).double()
    sigma = (n * p * (1 - p)).double().sqrt()
    assert ((counts - n * p).abs() <= 5 * sigma).all(), (counts, n * p)
    # temperature 2 flattens: p^(1/2), renormalised
    flat = p.sqrt() / p.sqrt().sum()
    tokens, _ = sample_tokens(logprobs, [SamplingParams(temperature=2.0)] * n, [1.0 - rng.random() for _ in range(n)])
    counts = torch.bincount(torch.tensor(tokens), minlength=4).double()
    assert ((counts - n * flat).abs() <= 5 * (n * flat * (1 - flat)).double().sqrt()).all(), (counts, n * flat)


def test_a_row_without_probability_fails_alone():
    logprobs = torch.log_softmax(torch.randn(3, 16), dim=-1)
    logprobs[1] = math.nan
    tokens, valid = sample_tokens(logprobs, [SamplingParams()] * 3, [0.5, 0.5, 0.5])
    assert valid == [True, False, True]
    assert all(0 <= t < 16 for t in tokens)
