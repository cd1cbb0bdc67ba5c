"""Continuous batching for the embedded engine: one scheduler thread owns the model and the KV cache.

Each iteration runs the control commands queued by the HTTP server (pause, abort, weight swap, ...),
then, unless paused, admits waiting requests with one left-padded batched prefill, merges their KV
into the running batch and runs one batched decode step for every running request. Finished rows
leave the batch at once; new requests join at the next iteration (continuous batching).

Pause modes (SGLang's): `abort` finishes every request now with finish reason abort and its partial
tokens, logprobs and routing; `retract` drops the KV of running requests and puts them back at the
head of the queue (recomputed on `continue`); `in_place` keeps everything and just stops stepping.

Logprobs: each sampled token reports the raw model log-softmax (temperature 1, before top-k/top-p),
i.e. log pi(token | prefix) of the policy, which is what the trainer recomputes. A prefill that
admits a request asking for prompt logprobs (`logprob_start_len` >= 0) computes every position's
logits; a prefill-only request (`max_new_tokens=0`: a score, e.g. the consistency probe's) leaves
right after it, holding no KV, so a full batch (`max_batch`) does not hold it back.

Speculative decoding (a runner with `speculative_steps` > 0): each decode iteration is
`speculative.Speculation.step` (k MTP drafts, one verifying forward, the acceptance rule, roll
back), emitting 1 to k + 1 tokens per request; the draft's KV is one more slot of the same cache, so
merging, retracting and removing rows treat target and draft alike. A weight swap invalidates the
running requests' pending drafts (they came from the previous version's draft).
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from typing import Callable

import torch
from transformers import DynamicCache

from moe_rl.engine.embedded.request import Request
from moe_rl.engine.embedded.runner import ModelRunner, Staged
from moe_rl.engine.embedded.sampler import sample_tokens
from moe_rl.engine.embedded.speculative import Speculation, compact
from moe_rl.trace import TRACER


class Scheduler:
    def __init__(self, runner: ModelRunner, weight_version: str, max_batch: int = 64):
        self.runner = runner
        self.weight_version = weight_version
        self.max_batch = max_batch
        self.paused = False
        self.holding = False  # a committed version is being loaded: no request starts before its swap
        self._cond = threading.Condition()
        self._waiting: collections.deque[Request] = collections.deque()
        self._commands: collections.deque = collections.deque()
        self._running: list[Request] = []
        self._admitting: list[Request] = []  # taken from the queue for the prefill under way
        self._cache: DynamicCache | None = None
        self._mask: torch.Tensor | None = None  # [B, T] 1 = real token, left padded
        self._stopping = False
        self.speculation = Speculation(runner) if runner.speculative_steps else None
        self._thread = threading.Thread(target=self._loop, name="embedded-scheduler", daemon=True)
        self._thread.start()

    # -- called from the HTTP thread ---------------------------------------------------------------

    def submit(self, request: Request) -> None:
        with self._cond:
            self._waiting.append(request)
            self._cond.notify()

    def call(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run `fn` on the scheduler thread between two steps; returns its future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            self._commands.append((fn, future))
            self._cond.notify()
        return future

    def hold(self) -> None:
        """Start no request until the next `set_weights` (or `release`): a commit was answered and
        its version is being loaded; running requests go on."""
        with self._cond:
            self.holding = True

    def release(self) -> None:
        """Start requests again (the version being loaded failed: the served one stays)."""
        with self._cond:
            self.holding = False
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout=10)

    @property
    def num_requests(self) -> int:
        return len(self._running) + len(self._waiting)

    def load(self) -> tuple[int, int, int, int]:
        """(running requests, waiting requests, tokens the running ones hold in the KV cache,
        prompt tokens of the waiting ones); run it on the scheduler thread."""
        used = sum(len(r.input_ids) + len(r.output_ids) for r in self._running)
        return len(self._running), len(self._waiting), used, sum(len(r.input_ids) for r in self._waiting)

    # -- control commands (run on the scheduler thread via `call`) ---------------------------------

    def pause(self, mode: str) -> None:
        if mode == "abort":
            self.abort(None)
        elif mode == "retract":
            for request in reversed(self._running):
                self._waiting.appendleft(request)
            self._drop_batch()
        self.paused = True

    def unpause(self) -> None:
        self.paused = False

    def abort(self, rid: str | None) -> int:
        """Finish the request `rid` (every request when None) with finish reason abort."""
        aborted = 0
        for request in [r for r in self._waiting if rid is None or r.rid == rid]:
            self._waiting.remove(request)
            request.finish({"type": "abort", "message": "Aborted"}, self.weight_version)
            aborted += 1
        doomed = [i for i, r in enumerate(self._running) if rid is None or r.rid == rid]
        for i in doomed:
            self._running[i].finish({"type": "abort", "message": "Aborted"}, self.weight_version)
        self._remove_rows(doomed)
        return aborted + len(doomed)

    @property
    def idle(self) -> bool:
        """Nothing holds KV and nothing would run: no running request, and the queue is empty
        unless generation is paused (SGLang's condition for releasing memory)."""
        return not self._running and (self.paused or not self._waiting)

    def release_kv_cache(self) -> None:
        """Drop the KV cache (SGLang's "kv_cache" memory tag). The embedded engine keeps KV only for
        running requests, so when idle this frees whatever the last batch left."""
        assert self.idle, "release only when idle"
        self._drop_batch()

    def set_weights(self, staged: Staged, version: str) -> None:
        """Swap in a staged version: the next forward uses it, tokens after it carry `version`."""
        self.runner.swap(staged)
        self.weight_version = version
        self.holding = False
        for request in self._running:  # drafted by the previous version's draft: none is used
            request.draft_state = None

    # -- the loop ----------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._stopping or self._commands or (not self.paused and self._work)):
                    self._cond.wait()
                if self._stopping:
                    return
                commands = list(self._commands)
                self._commands.clear()
            for fn, future in commands:
                try:
                    with TRACER.span(getattr(fn, "__name__", "command").lstrip("_")):
                        future.set_result(fn())
                except Exception as error:  # reported to the caller, the loop keeps serving
                    future.set_exception(error)
            if self.paused:
                continue
            try:
                self._admit()
                if self._running:
                    self._decode()
            except Exception as error:  # a model error fails the requests of that forward only
                for request in self._running + self._admitting:
                    request.fail(error)
                self._admitting = []
                self._drop_batch()

    @property
    def _work(self) -> bool:
        """Something to run (when not paused): running requests, or waiting ones not held."""
        return bool(self._running) or (bool(self._waiting) and not self.holding)

    def _admit(self) -> None:
        if self.holding:
            return
        with self._cond:
            new, held, room = [], collections.deque(), self.max_batch - len(self._running)
            for request in self._waiting:  # a prefill-only request leaves after its prefill: no decode slot
                if request.prefill_only or room > 0:
                    new.append(request)
                    room -= not request.prefill_only
                else:
                    held.append(request)
            self._waiting, self._admitting = held, new
        if not new:
            return
        sequences = [r.input_ids + r.output_ids for r in new]
        width = max(len(s) for s in sequences)
        ids = torch.zeros(len(new), width, dtype=torch.long)
        mask = torch.zeros(len(new), width, dtype=torch.long)
        for row, seq in enumerate(sequences):
            ids[row, width - len(seq) :] = torch.tensor(seq)
            mask[row, width - len(seq) :] = 1
        cache = DynamicCache()
        score = any(r.wants_input_logprobs for r in new)
        with TRACER.span("prefill", rows=len(new), width=width):
            logprobs, routed, inputs = self.runner.forward(ids, mask, cache, [r.lora_name for r in new], score)
        for row, (request, seq) in enumerate(zip(new, sequences)):
            fed = routed[row, width - len(seq) :]
            request.add_routing(fed[request.num_routed_rows :])
            if request.wants_input_logprobs:  # the prompt's tokens sit from column width - len(seq)
                request.set_input_logprobs(inputs[row, width - len(seq) :].tolist())
        done = self._sample(new, logprobs)
        if self.speculation is not None:
            self.speculation.prefill(new, ids, mask, cache)
        first = len(self._running)
        self._merge(new, cache, mask)
        self._admitting = []
        self._remove_rows([first + i for i in done])

    def _decode(self) -> None:
        if self.speculation is not None:
            self._speculate()
            return
        ids = torch.tensor([[r.output_ids[-1]] for r in self._running], dtype=torch.long)
        self._mask = torch.cat([self._mask, torch.ones(len(self._running), 1, dtype=torch.long)], dim=1)
        adapters = [r.lora_name for r in self._running]
        with TRACER.span("decode", rows=len(self._running)):
            logprobs, routed, _ = self.runner.forward(ids, self._mask, self._cache, adapters)
        for row, request in enumerate(self._running):
            request.add_routing(routed[row])
        self._remove_rows(self._sample(self._running, logprobs))

    def _speculate(self) -> None:
        with TRACER.span("speculate", rows=len(self._running)):
            emitted, self._mask = self.speculation.step(self._running, self._mask, self._cache)
        done = []
        for row, (request, out) in enumerate(zip(self._running, emitted)):
            if not out.valid:
                request.fail(ValueError(f"request {request.rid}: no finite probability to sample from"))
                done.append(row)
                continue
            request.spec_verify_ct += out.proposed > 0
            request.spec_num_proposed_drafts += out.proposed
            for j, (token, logprob) in enumerate(zip(out.tokens, out.logprobs)):
                request.add_routing(out.routing[j : j + 1])  # the row of the token fed before it
                request.spec_num_correct_drafts += j < out.accepted
                if self._emit(request, token, logprob):
                    done.append(row)
                    break
        self._mask = compact(self._cache, self._mask)
        self._remove_rows(done)

    def _emit(self, request: Request, token: int, logprob: float) -> bool:
        """Append a sampled token; finish the request if it is done (returns whether it is)."""
        request.append_token(token, logprob, self.weight_version)
        reason = request.finish_reason_now()
        if reason is not None:
            request.finish(reason, self.weight_version)
        return reason is not None

    def _sample(self, rows: list[Request], logprobs: torch.Tensor) -> list[int]:
        """Sample the next token of `rows` from `logprobs` [rows, V] (one batched draw,
        `sampler.sample_tokens`); finish the requests that are done; returns their indices."""
        done = [i for i, request in enumerate(rows) if request.prefill_only]
        for row in done:  # max_new_tokens=0: scored, nothing to sample (SGLang's finish)
            rows[row].finish({"type": "length", "length": 0}, self.weight_version)
        sampling = [i for i, request in enumerate(rows) if not request.prefill_only]
        if sampling:
            picked = logprobs[sampling] if len(sampling) < len(rows) else logprobs
            tokens, valid = sample_tokens(
                picked, [rows[i].params for i in sampling], [rows[i].uniform() for i in sampling]
            )
            chosen = picked.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()
            for i, token, logprob, ok in zip(sampling, tokens, chosen, valid):
                request = rows[i]
                if not ok:  # this row's scores had no probability mass: it fails, no other request
                    request.fail(ValueError(f"request {request.rid}: no finite probability to sample from"))
                    done.append(i)
                elif self._emit(request, token, logprob):
                    done.append(i)
        return sorted(done)

    # -- KV cache bookkeeping ----------------------------------------------------------------------

    def _merge(self, new: list[Request], cache: DynamicCache, mask: torch.Tensor) -> None:
        if not self._running:
            self._running, self._cache, self._mask = list(new), cache, mask
            return
        width = max(self._mask.shape[1], mask.shape[1])

        def pad(t: torch.Tensor, dim: int) -> torch.Tensor:
            missing = width - t.shape[dim]
            if missing == 0:
                return t
            shape = list(t.shape)
            shape[dim] = missing
            return torch.cat([t.new_zeros(shape), t], dim=dim)

        layers = [
            (torch.cat([pad(old.keys, 2), pad(add.keys, 2)]), torch.cat([pad(old.values, 2), pad(add.values, 2)]))
            for old, add in zip(self._cache.layers, cache.layers)
        ]
        self._cache = DynamicCache(ddp_cache_data=layers)
        self._mask = torch.cat([pad(self._mask, 1), pad(mask, 1)])
        self._running.extend(new)

    def _remove_rows(self, rows: list[int]) -> None:
        if not rows:
            return
        gone = set(rows)
        keep = [i for i in range(len(self._running)) if i not in gone]
        if not keep:
            self._drop_batch()
            return
        self._running = [self._running[i] for i in keep]
        index = torch.tensor(keep)
        self._mask = self._mask[index]
        start = int((self._mask.sum(0) > 0).nonzero()[0])  # drop columns that are padding for every row
        self._mask = self._mask[:, start:]
        for layer in self._cache.layers:
            layer.keys = layer.keys[index, :, start:]
            layer.values = layer.values[index, :, start:]

    def _drop_batch(self) -> None:
        self._running, self._cache, self._mask = [], None, None
