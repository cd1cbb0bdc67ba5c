"""Speculative decoding in the embedded engine: k MTP drafts, one verifying forward, the standard rule.

One decode iteration over the running batch (`Speculation.step`):
1. draft: each row's first draft distribution q1 is ready (the draft's output at its last
   position, from the previous iteration or the prefill); d1 ~ q1, then k - 1 chained draft steps
   (`draft.MtpDraft`), each one column of the draft's KV slot, cropped afterwards;
2. verify: one forward of the main model over [last token, d1..dk] gives the target p at each of
   the k + 1 positions, their routed experts and final hidden states;
3. accept (`accept`): d_j is kept with probability min(1, p_j(d_j) / q_j(d_j)); at the first
   rejection a token is drawn from norm(max(0, p_j - q_j)); when all k are kept, a bonus token from
   p_{k+1}. p and q are the distributions the request samples from (temperature, top-k, top-p:
   `sampler.probabilities`), so the output is distributed exactly as without speculation; greedy
   rows (one-hot p and q) output exactly the non-speculative greedy tokens;
4. roll back: the KV columns of rejected drafts are masked out (positions come from the mask's
   cumulative sum, so a hole is as if never fed) and compacted away (`compact`);
5. draft extend: the draft reads the target's hidden states of the kept positions and their next
   tokens, filling its KV slot to the target's length and giving the next iteration's q1.

Logprobs and routed experts of the emitted tokens are the verifying forward's (the target's): token
j of the iteration gets column j's logprob and the routing row of the token fed at column j. A row
with no valid draft (after a weight swap: its q1 came from the previous version's draft) drafts
nothing that iteration and samples from p_1 as plain decoding does.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from transformers import DynamicCache

from moe_rl.engine.embedded.request import Request
from moe_rl.engine.embedded.runner import ModelRunner
from moe_rl.engine.embedded.sampler import SAMPLING_EPS, draw, probabilities


def accept(
    target: torch.Tensor,
    draft: torch.Tensor,
    drafts: torch.Tensor,
    proposed: torch.Tensor,
    accept_uniforms: torch.Tensor,
    final_uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The standard speculative-sampling rule, per row: `target` p [B, k + 1, V] and `draft` q
    [B, k, V] (normalized), the drafted tokens [B, k] (drawn from q), `proposed` [B] the drafts
    that count (the rest are rejected as if p were 0 there), uniforms in (0, 1] [B, k] and [B].
    Returns (accepted drafts [B], the token that follows them [B])."""
    rows, k = drafts.shape
    p_d = target[:, :k].gather(2, drafts[..., None])[..., 0]
    q_d = draft.gather(2, drafts[..., None])[..., 0]
    kept = (accept_uniforms * q_d <= p_d) & (torch.arange(k)[None, :] < proposed[:, None])
    accepted = kept.int().cumprod(1).sum(1)
    index = torch.arange(rows)
    p = target[index, accepted]
    residual = (p - draft[index, accepted.clamp(max=k - 1)]).clamp_min(0)
    # p == q leaves no residual mass, but then no draft can be rejected: p is only a guard
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
    final = torch.where((accepted < proposed)[:, None], residual, p)
    return accepted, draw(final, final_uniforms)


@dataclasses.dataclass
class Emitted:
    """What one row emits in an iteration: tokens with the target's logprobs, the routing row of the
    token fed before each [tokens, layers, topk], drafts kept and proposed, and whether p was valid."""

    tokens: list[int]
    logprobs: list[float]
    routing: np.ndarray
    accepted: int
    proposed: int
    valid: bool


class Speculation:
    """The speculative iteration (module docstring) over the scheduler's batch, cache and mask."""

    def __init__(self, runner: ModelRunner):
        self.runner, self.k = runner, runner.speculative_steps
        self.slot = runner.num_layers  # the draft's KV slot in the cache

    def prefill(self, rows: list[Request], ids: torch.Tensor, mask: torch.Tensor, cache: DynamicCache) -> None:
        """After the prefill of `rows` (right-aligned `ids` [B, W], `mask`, `cache`) and their first
        sampled token: fill the draft's KV slot over the prompts, set each row's first draft q1."""
        first = torch.tensor([r.output_ids[-1] if r.output_ids else 0 for r in rows])
        following = torch.cat([ids[:, 1:], first[:, None]], dim=1)
        logprobs, hidden = self.runner.draft(self.runner.hidden, following, mask, cache)
        for row, request in enumerate(rows):
            request.draft_state = (logprobs[row, -1].cpu(), hidden[row, -1])

    def step(self, rows: list[Request], mask: torch.Tensor, cache: DynamicCache) -> tuple[list[Emitted], torch.Tensor]:
        """One iteration for `rows`; returns what each row emits and the new mask (the cache is
        updated in place: verified, rolled back, extended; compacting is the caller's `compact`)."""
        k, batch, draft = self.k, len(rows), self.runner.draft
        params = [r.params for r in rows]
        proposed = torch.tensor([k if r.draft_state is not None else 0 for r in rows])
        vocab, width = self.runner.vocab_size, self.runner.config.get_text_config().hidden_size
        stale = (torch.zeros(vocab), torch.zeros(width, device=draft.eh_proj.weight.device))
        states = [r.draft_state or stale for r in rows]
        draft_logprobs, g = torch.stack([s[0] for s in states]), torch.stack([s[1] for s in states])
        drafts, qs = [], []
        for j in range(k):
            q = normalized(probabilities(draft_logprobs, params))
            qs.append(q)
            drafts.append(draw(q, torch.tensor([r.uniform() for r in rows])))
            if j < k - 1:  # the next draft reads this one: one column of the draft's slot
                ext = torch.cat([mask, torch.ones(batch, j + 1, dtype=mask.dtype)], dim=1)
                step_logprobs, step_g = draft(g[:, None], drafts[-1][:, None], ext, cache)
                draft_logprobs, g = step_logprobs[:, 0].cpu(), step_g[:, 0]
        if k > 1:  # chained drafts are not the target's positions: off the draft's slot again
            layer = cache.layers[self.slot]
            layer.keys, layer.values = layer.keys[:, :, : -(k - 1)], layer.values[:, :, : -(k - 1)]
        drafted = torch.stack(drafts, dim=1)
        fed = torch.cat([torch.tensor([[r.output_ids[-1]] for r in rows]), drafted], dim=1)
        mask = torch.cat([mask, torch.ones(batch, k + 1, dtype=mask.dtype)], dim=1)
        logprobs, routed, hidden = self.runner.verify(fed, mask, cache, [r.lora_name for r in rows])
        column_params = [p for p in params for _ in range(k + 1)]
        target = probabilities(logprobs.reshape(batch * (k + 1), vocab), column_params).reshape(batch, k + 1, vocab)
        total = target.sum(-1)
        greedy = torch.tensor([p.temperature < SAMPLING_EPS for p in params])
        valid = greedy | (torch.isfinite(total) & (total > 0)).all(1)
        target = normalized(target.nan_to_num(0.0))
        accept_uniforms = torch.tensor([[r.uniform() for _ in range(k)] for r in rows])
        accepted, final = accept(
            target,
            torch.stack(qs, dim=1),
            drafted,
            proposed,
            accept_uniforms,
            torch.tensor([r.uniform() for r in rows]),
        )
        # roll back: the rejected drafts' columns leave the mask (the draft's slot included, below)
        keep = torch.arange(k + 1)[None, :] <= accepted[:, None]
        mask[:, -(k + 1) :] = keep.to(mask.dtype)
        following = torch.cat([drafted, final[:, None]], dim=1)
        following[torch.arange(batch), accepted] = final
        next_logprobs, next_g = draft(hidden, following, mask, cache)
        emitted = []
        for row, request in enumerate(rows):
            a = int(accepted[row])
            request.draft_state = (next_logprobs[row, a].cpu(), next_g[row, a])
            tokens = following[row, : a + 1].tolist()
            chosen = logprobs[row, torch.arange(a + 1), following[row, : a + 1]].tolist()
            emitted.append(Emitted(tokens, chosen, routed[row, : a + 1], a, int(proposed[row]), bool(valid[row])))
        return emitted, mask


def normalized(probs: torch.Tensor) -> torch.Tensor:
    return probs / probs.sum(-1, keepdim=True).clamp_min(torch.finfo(probs.dtype).tiny)


def compact(cache: DynamicCache, mask: torch.Tensor) -> torch.Tensor:
    """Move each row's kept columns right (holes become left padding, order kept) in every KV
    slot, drop columns that are padding for every row; returns the new mask."""
    order = torch.sort(mask, dim=1, stable=True).indices
    mask = mask.gather(1, order)
    start = int((mask.sum(0) > 0).nonzero()[0])
    for layer in cache.layers:
        index = order[:, None, :, None].to(layer.keys.device)
        layer.keys = layer.keys.gather(2, index.expand_as(layer.keys))[:, :, start:]
        layer.values = layer.values.gather(2, index.expand_as(layer.values))[:, :, start:]
    return mask[:, start:]
