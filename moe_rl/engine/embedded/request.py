"""One generation request inside the embedded engine: sampling state, outputs and its SGLang response.

The response has SGLang's shape: `output_ids` and `meta_info` with `id`, `finish_reason`
({"type": "length"|"stop"|"abort", ...}), `prompt_tokens`, `completion_tokens`, `weight_version`,
`weight_versions` (spans {version, start, end} over output tokens, as SGLang 0.5.23),
`output_token_logprobs` ([logprob, token_id, None] per output token), `input_token_logprobs` ([logprob,
token_id, None] per prompt token from `logprob_start_len`, the first one's logprob None; empty by
default) and `routed_experts` (base64 int32 [prompt + output - 1 - routed_experts_start_len, layers, topk]).
A speculating engine adds SGLang's speculative fields once a verifying forward has run for the
request (`spec_verify_ct` > 0, as SGLang's `tokenizer_manager`): `spec_verify_ct` (verifying forwards
with drafts), `spec_num_proposed_drafts`, `spec_num_correct_drafts` (drafts emitted),
`spec_accept_rate` (correct / proposed) and `spec_accept_length` (completion_tokens / spec_verify_ct).

A request with `max_new_tokens=0` is prefill-only (SGLang's scoring route, what a served teacher
answers): it finishes at its prefill with finish reason {"type": "length", "length": 0}, no output.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Callable

import numpy as np

from moe_rl.engine.sampling import SamplingParams
from moe_rl.sample import encode_routed_experts


@dataclasses.dataclass(kw_only=True, eq=False)
class Request:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    return_logprob: bool = False
    logprob_start_len: int = -1
    """The first prompt token of `input_token_logprobs` (-1: none, SGLang's default)."""
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    lora_name: str | None = None
    on_done: Callable[[dict | Exception], None] = lambda result: None
    output_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    version_spans: list[dict] = dataclasses.field(default_factory=list)
    routed: list[np.ndarray] = dataclasses.field(default_factory=list)
    num_routed_rows: int = 0
    draft_state: tuple | None = None
    """Speculation: (the draft's log-softmax of the first draft [V], its hidden state [H]) after the
    row's last position; None when no valid draft exists (`speculative.Speculation`)."""
    spec_verify_ct: int = 0
    spec_num_proposed_drafts: int = 0
    spec_num_correct_drafts: int = 0
    input_logprobs: list[float | None] | None = None
    """log p(input_ids[t] | input_ids[:t]) for t from logprob_start_len (None at that first one, as
    SGLang); set by the first prefill (a retracted request keeps them)."""

    def __post_init__(self) -> None:
        seed = self.params.sampling_seed
        # the request's own draws (`sampler.sample_tokens`): seeded, independent of its batchmates
        self.rng = random.Random(seed if seed is not None else random.getrandbits(63))

    def uniform(self) -> float:
        """This request's next uniform number in (0, 1] for `sampler.sample_tokens`."""
        return 1.0 - self.rng.random()

    @property
    def prefill_only(self) -> bool:
        return self.params.max_new_tokens == 0

    @property
    def wants_input_logprobs(self) -> bool:
        """Its prefill must score the prompt's tokens (not done yet)."""
        return self.return_logprob and self.logprob_start_len >= 0 and self.input_logprobs is None

    def set_input_logprobs(self, token_logprobs: list[float]) -> None:
        """`token_logprobs[t - 1]` = log p(input_ids[t] | input_ids[:t]) for t in 1..len(input_ids) - 1."""
        start = self.logprob_start_len
        self.input_logprobs = [None] + token_logprobs[start:] if start < len(self.input_ids) else []

    def add_routing(self, rows: np.ndarray) -> None:
        self.routed.append(rows)
        self.num_routed_rows += rows.shape[0]

    def append_token(self, token: int, logprob: float, version: str) -> None:
        n = len(self.output_ids)
        self.output_ids.append(token)
        self.logprobs.append(logprob)
        if self.version_spans and self.version_spans[-1]["version"] == version:
            self.version_spans[-1]["end"] = n + 1
        else:
            self.version_spans.append({"version": version, "start": n, "end": n + 1})

    def finish_reason_now(self) -> dict | None:
        token = self.output_ids[-1]
        if token in self.params.stop_token_ids or (not self.params.ignore_eos and token in self.eos_token_ids):
            return {"type": "stop", "matched": token}
        if len(self.output_ids) >= self.params.max_new_tokens:
            return {"type": "length", "length": len(self.output_ids)}
        return None

    def finish(self, reason: dict, current_version: str) -> None:
        self.on_done(self.response(reason, current_version))

    def fail(self, error: Exception) -> None:
        self.on_done(error)

    def response(self, reason: dict, current_version: str) -> dict:
        meta = {
            "id": self.rid,
            "finish_reason": reason,
            "prompt_tokens": len(self.input_ids),
            "completion_tokens": len(self.output_ids),
            "weight_version": self.version_spans[-1]["version"] if self.version_spans else current_version,
            "weight_versions": [dict(span) for span in self.version_spans],
        }
        if self.return_logprob:
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(self.logprobs, self.output_ids)]
            scored = zip(self.input_logprobs or [], self.input_ids[max(self.logprob_start_len, 0) :])
            meta["input_token_logprobs"] = [[lp, tok, None] for lp, tok in scored]
        if self.spec_verify_ct:
            meta.update(
                spec_verify_ct=self.spec_verify_ct,
                spec_num_proposed_drafts=self.spec_num_proposed_drafts,
                spec_num_correct_drafts=self.spec_num_correct_drafts,
                spec_accept_rate=self.spec_num_correct_drafts / max(self.spec_num_proposed_drafts, 1),
                spec_accept_length=len(self.output_ids) / self.spec_verify_ct,
            )
        if self.return_routed_experts and self.routed:
            rows = np.concatenate(self.routed)[: len(self.input_ids) + len(self.output_ids) - 1]
            meta["routed_experts"] = encode_routed_experts(rows[self.routed_experts_start_len :])
        return {"output_ids": list(self.output_ids), "meta_info": meta}
