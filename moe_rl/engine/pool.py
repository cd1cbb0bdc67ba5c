"""`EnginePool`: routes generate calls over several engines, and around engines that died.

All samples of a group (same prompt, GRPO) go to one engine, so its prefix cache (SGLang's radix
tree) computes the shared prompt once; a group's first request, and any request without a group,
goes to the live engine with the fewest requests in flight (ties: the first). The mapping lives
until `release_group`. A group's requests made together go as one batch request (`GroupBatch`).
Control calls (pause, continue, weight updates) go to every engine through the clients themselves
(or `sync`'s sender); the pool only routes generation (and scoring: `score`).

Faults: a generate call that gets no HTTP answer (connection refused or reset) makes the pool ask
the engine's `/health` (one check shared by every request that failed on it). An engine that does
not answer is marked dead: it gets no new work, its groups move to other engines, and each of its
requests is resubmitted unchanged to a live engine (`resubmitted`): the caller's sample keeps the
segments it already has, only the lost segment is generated again. With no engine live, requests
wait. Whoever restarts a dead engine and re-syncs its weights calls `revive(index, client)`.

Elastic engines (`moe_rl.rl.fleet`): `add(index, client)` gives a new engine (already serving
the current weights) a slot at its index and work at once; `remove(index)` takes one out: no new
work, its groups move, and every request it still runs is aborted until none is left (each comes
back with finish reason "abort" and its tokens so far, so the caller continues it elsewhere, as
after an abort-mode weight swap). Indices are names (`engine_name`): a removed engine's slot stays
empty (`clients[index]` None); the fleet never gives its index to another engine.

Counters over every completed request: `generated_tokens`, and `spec` (speculative decoding: the
sums of SGLang's meta info `spec_verify_ct`, `spec_num_proposed_drafts`, `spec_num_correct_drafts`,
which the embedded engine reports too, and `spec_verified_tokens`: the output tokens of requests
that ran a verify, less the one each request's prefill made), from which the RL loop takes each
step's `rollout/spec_accept_rate` and `rollout/spec_tokens_per_forward` (`moe_rl.rl.step_clock`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Awaitable, Callable, TypeVar

from moe_rl.engine.client import EngineClient, EngineError, GenerateResult, ScoreResult
from moe_rl.engine.sampling import SamplingParams
from moe_rl.trace import TRACER

SPEC_META = ("spec_verify_ct", "spec_num_proposed_drafts", "spec_num_correct_drafts")
"""SGLang's speculative meta-info counts, summed as they are."""
SPEC_COUNTERS = (*SPEC_META, "spec_verified_tokens")

Served = TypeVar("Served")


class EnginePool:
    def __init__(self, clients: list[EngineClient]):
        if not clients:
            raise ValueError("EnginePool needs at least one EngineClient")
        self.clients: list[EngineClient | None] = list(clients)  # None: a removed engine's slot
        self.in_flight = [0] * len(clients)
        self.live = [True] * len(clients)
        self.served = [0] * len(clients)  # requests each engine completed since it was (re)started
        # per engine, the lowest and highest token version it generated since it got work (None: none yet)
        self.versions: list[tuple[int, int] | None] = [None] * len(clients)
        self.resubmitted = 0  # requests lost with a dead engine and sent to another one
        self.added = self.removed = 0  # engines that joined / left the pool (`add`, `remove`)
        self.cut = 0  # requests aborted on an engine being removed (continued elsewhere by the caller)
        self.generated_tokens = 0  # output tokens of every completed request (continued segments included)
        self.spec = dict.fromkeys(SPEC_COUNTERS, 0)  # the same requests' speculative counters, summed
        self._active_s = [0.0] * len(clients)  # wall seconds with >= 1 request in flight, per engine
        self._active_since: list[float | None] = [None] * len(clients)
        self._groups: dict[str, int] = {}
        self._checks: dict[int, asyncio.Task] = {}  # running health check per engine
        self._any_live = asyncio.Event()
        self._any_live.set()
        self._forming: dict[tuple, GroupBatch] = {}  # batches taking requests in this loop pass

    def pick(self, group_id: str | None = None) -> int:
        """Index of the live engine for the next request of `group_id` (recorded for the group)."""
        index = self._groups.get(group_id) if group_id is not None else None
        if index is not None and self.live[index]:
            return index
        live = [i for i, up in enumerate(self.live) if up]
        if not live:
            raise RuntimeError("no live engine: wait for one to be revived")
        index = min(live, key=lambda i: self.in_flight[i])
        if group_id is not None:
            self._groups[group_id] = index
        return index

    def release_group(self, group_id: str) -> None:
        self._groups.pop(group_id, None)

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, *, group_id: str | None = None, **options
    ) -> GenerateResult:
        """`EngineClient.generate` on the engine `pick(group_id)` chose; resubmitted if it dies. A
        group's requests made in one pass of the event loop with the same `options` (a group's
        samples, started together) go as one batch request (`GroupBatch`)."""
        if group_id is None:
            index, result = await self._on_live_engine(
                None, lambda client: client.generate(input_ids, sampling, **options)
            )
            self._count(index, result)
            return result
        key = (group_id, tuple(sorted(options.items())))
        batch = self._forming.get(key)
        if batch is None:
            batch = self._forming[key] = GroupBatch(group_id, options)
            asyncio.get_running_loop().call_soon(self._send, key)  # after this pass's other requests
        return await batch.add(input_ids, sampling)

    def _send(self, key: tuple) -> None:
        batch = self._forming.pop(key)
        batch.drop_cancelled()
        if batch.waiters:
            batch.task = asyncio.get_running_loop().create_task(self._run_batch(batch))

    async def _run_batch(self, batch: GroupBatch) -> None:
        async def call(client: EngineClient) -> list[GenerateResult]:
            batch.engine = client
            if len(batch.inputs) == 1:  # SGLang's single form: what the batch would be without batching
                return [await client.generate(batch.inputs[0], batch.sampling[0], rid=batch.rids[0], **batch.options)]
            return await client.generate_batch(batch.inputs, batch.sampling, rids=batch.rids, **batch.options)

        try:
            index, results = await self._on_live_engine(batch.group_id, call, len(batch.inputs))
        except Exception as error:  # noqa: BLE001 - every caller of the batch gets it
            batch.fail(error)
            return
        for result in results:
            self._count(index, result)
        batch.resolve(results)

    def _count(self, index: int, result: GenerateResult) -> None:
        self.generated_tokens += len(result.output_ids)
        if result.meta_info.get("spec_verify_ct"):  # SGLang's speculative meta info (none without it)
            for name in SPEC_META:
                self.spec[name] += int(result.meta_info[name])
            self.spec["spec_verified_tokens"] += len(result.output_ids) - 1  # the prefill made the first
        if result.weight_versions:
            low, high = min(result.weight_versions), max(result.weight_versions)
            seen = self.versions[index]
            self.versions[index] = (low, high) if seen is None else (min(seen[0], low), max(seen[1], high))

    async def score(self, input_ids: list[int], **kwargs) -> ScoreResult:
        """`EngineClient.score` (a prefill-only request of its own, in no group) on the live engine
        with the fewest requests in flight; resubmitted if it dies."""
        _, result = await self._on_live_engine(None, lambda client: client.score(input_ids, **kwargs))
        return result

    async def _on_live_engine(
        self, group_id: str | None, call: Callable[[EngineClient], Awaitable[Served]], requests: int = 1
    ) -> tuple[int, Served]:
        """(engine index, `call(client)`) on the engine `pick(group_id)` chose, again on another
        one if it died; `call` makes `requests` requests (a batch's items)."""
        while True:
            await self._any_live.wait()
            index = self.pick(group_id)
            client = self.clients[index]
            self._enter(index, requests)
            try:
                result = await call(client)
            except EngineError as error:
                if error.status is not None or not await self._died(index, client):
                    raise
                self.resubmitted += requests
                continue
            finally:
                self._leave(index, requests)
            self.served[index] += requests
            return index, result

    def _enter(self, index: int, requests: int) -> None:
        if self.in_flight[index] == 0:
            self._active_since[index] = time.time()
        self.in_flight[index] += requests

    def _leave(self, index: int, requests: int) -> None:
        self.in_flight[index] -= requests
        if self.in_flight[index] == 0:
            now = time.time()
            self._active_s[index] += now - self._active_since[index]
            self._trace_active(index, now)
            self._active_since[index] = None

    def _trace_active(self, index: int, end: float) -> None:
        """The timeline's span of engine `index` having requests in flight, up to `end` (from the
        trace's start at the earliest): the engine as its client sees it, SGLang's too."""
        if not TRACER.on:  # every request's end passes here: nothing to build while the trace is off
            return
        start = max(self._active_since[index], TRACER.started)
        TRACER.add("requests in flight", start, end, lane=f"{self.clients[index].name} (client view)")

    def trace_in_flight(self) -> None:
        """Close the timeline's spans of engines still busy now (before the trace stops)."""
        now = time.time()
        for index, since in enumerate(self._active_since):
            if since is not None:
                self._trace_active(index, now)

    def active_seconds(self) -> list[float]:
        """Per engine: wall seconds so far with at least one request in flight (the engine's
        busy time as its client sees it; read twice, the difference covers the span between)."""
        now = time.time()
        return [
            total + (now - since if since is not None else 0.0)
            for total, since in zip(self._active_s, self._active_since)
        ]

    async def _died(self, index: int, client: EngineClient) -> bool:
        """Whether the engine behind `client` is dead (marks it dead the first time)."""
        if client is not self.clients[index] or not self.live[index]:
            return True  # already known dead (or since replaced by a restarted process)
        check = self._checks.get(index)
        if check is None:
            check = self._checks[index] = asyncio.ensure_future(client.health())
            check.add_done_callback(lambda _: self._checks.pop(index, None))
        healthy = await asyncio.shield(check)
        if not healthy and client is self.clients[index]:
            self.mark_dead(index)
        return not healthy

    def mark_dead(self, index: int) -> None:
        """No new work for engine `index`; its groups go elsewhere."""
        self.live[index] = False
        self._groups = {gid: i for gid, i in self._groups.items() if i != index}
        if not any(self.live):
            self._any_live.clear()

    async def revive(self, index: int, client: EngineClient) -> None:
        """Engine `index` is back (restarted, serving the current weights) at `client`."""
        old, self.clients[index] = self.clients[index], client
        self.live[index], self.served[index], self.versions[index] = True, 0, None
        self._any_live.set()
        if old is not client:
            await old.close()

    def add(self, index: int, client: EngineClient) -> None:
        """A new engine (serving the current weights) at slot `index`: an empty one, or one beyond
        every slot so far (slots skipped on the way stay empty until their engine joins). It gets
        work at once."""
        held = self.clients[index] if index < len(self.clients) else None
        if held is not None:
            raise ValueError(f"index: engine slot {index} holds {held.name}; give a new engine a free one")
        for slots in (self.clients, self.versions, self._active_since):
            slots.extend([None] * (index + 1 - len(slots)))
        for slots in (self.in_flight, self.served):
            slots.extend([0] * (index + 1 - len(slots)))
        self._active_s.extend([0.0] * (index + 1 - len(self._active_s)))
        self.live.extend([False] * (index + 1 - len(self.live)))
        self.clients[index], self.live[index] = client, True
        self.served[index], self.versions[index] = 0, None
        self.added += 1
        self._any_live.set()

    async def remove(self, index: int) -> int:
        """Take engine `index` out: no new work (its groups go elsewhere), then abort what it runs
        until nothing is in flight on it (a request that reached it after one abort is aborted by
        the next); each aborted request returns to its caller with its tokens so far. Returns how
        many requests were in flight when it was taken out. Its slot stays empty."""
        client = self.clients[index]
        if client is None:
            raise ValueError(f"index: engine slot {index} holds no engine")
        self.mark_dead(index)
        cut = self.in_flight[index]
        while self.in_flight[index]:
            try:
                await client.abort_request()
            except EngineError:  # it died meanwhile: its requests fail and are resubmitted (`_died`)
                pass
            await asyncio.sleep(_ABORT_POLL_S)
        self.clients[index] = None
        self.removed += 1
        self.cut += cut
        await client.close()
        return cut

    async def close(self) -> None:
        for client in self.clients:
            if client is not None:
                await client.close()


class GroupBatch:
    """Requests of one group, with the same options, made in one pass of the event loop: sent as
    one batch request (SGLang's batch /generate), which answers when all of them have ended. A
    group's samples end about together, and the group waits for its last one anyway; one exchange
    instead of one per sample saves the engine's and the caller's per-request work (HTTP, JSON, the
    loop's wakeups), which runs on the engine's core between its forwards. A caller that stops
    waiting (cancelled) has its item aborted on the engine; when every caller has, the batch's
    request is cancelled, and the engine aborts what is left of it."""

    def __init__(self, group_id: str, options: dict):
        self.group_id, self.options = group_id, options
        self.inputs: list[list[int]] = []
        self.sampling: list[SamplingParams] = []
        self.rids: list[str] = []
        self.waiters: list[asyncio.Future] = []
        self.task: asyncio.Task | None = None  # the request, once sent
        self.engine: EngineClient | None = None  # where it was sent
        self._aborts: set[asyncio.Task] = set()

    def add(self, input_ids: list[int], sampling: SamplingParams) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        future.add_done_callback(self._left)
        self.inputs.append(list(input_ids))
        self.sampling.append(sampling)
        self.rids.append(uuid.uuid4().hex)
        self.waiters.append(future)
        return future

    def drop_cancelled(self) -> None:
        """Forget the items whose callers stopped waiting before the batch was sent."""
        kept = [i for i, waiter in enumerate(self.waiters) if not waiter.cancelled()]
        for name in ("inputs", "sampling", "rids", "waiters"):
            setattr(self, name, [getattr(self, name)[i] for i in kept])

    def resolve(self, results: list[GenerateResult]) -> None:
        for waiter, result in zip(self.waiters, results):
            if not waiter.done():
                waiter.set_result(result)

    def fail(self, error: Exception) -> None:
        for waiter in self.waiters:
            if not waiter.done():
                waiter.set_exception(error)

    def _left(self, waiter: asyncio.Future) -> None:
        if not waiter.cancelled() or self.task is None or self.task.done():
            return
        if all(w.cancelled() for w in self.waiters):
            self.task.cancel()  # the engine aborts every item when the request goes away
        elif self.engine is not None:  # the others still wait: abort this item alone
            abort = asyncio.ensure_future(self._abort(self.engine, self.rids[self.waiters.index(waiter)]))
            self._aborts.add(abort)
            abort.add_done_callback(self._aborts.discard)

    @staticmethod
    async def _abort(engine: EngineClient, rid: str) -> None:
        try:
            await engine.abort_request(rid)
        except EngineError:  # the engine went away: nothing of the batch runs there any more
            pass


_ABORT_POLL_S = 0.02  # `remove`: how often it aborts again while requests are still in flight
