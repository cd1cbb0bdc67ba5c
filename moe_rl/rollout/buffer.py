"""`RolloutBuffer`: finished groups wait here for the trainer, within a staleness bound.

Owns three things, all on one asyncio event loop (the rollout manager's):

1. Admission (AReaL's capacity rule, by rounds). Round r is the r-th training batch of
   `groups_per_step` groups. The manager may start generating round r only while
   `r <= version + max_staleness`, where `version` is the policy version last given to
   `set_version` (the orchestrator calls it once the trainer's new weights are on the engines).
   With no drops this is "groups started - groups trained < (max_staleness + 1) * groups_per_step".
   Waiting for admission is generation back-pressure (`backpressure_waits`, `backpressure_s`).
2. Consumption. `get_batch(n_groups)` awaits n groups (the wait is `trainer_wait_s`). The
   staleness of a sample is `version - min(its per-token versions)`; a group whose stalest
   sample exceeds `max_staleness` is dropped (`stale_policy="drop"`, a fresh prompt replaces it)
   or regenerated under the same group id (`"requeue"`), counted either way; `on_reject` tells
   the manager, which starts the replacement so the trainer is never left short.
3. The ledger: every group id is delivered to the trainer exactly once or dropped exactly once
   (with a reason); `accounting()` reports the counts and `check_ledger` the invariant.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Callable

from moe_rl.sample import Sample

Group = list[Sample]
STALE_POLICIES = ("drop", "requeue")


def staleness(sample: Sample, version: int) -> int:
    """Trainer version minus the oldest weight version among the sample's model tokens."""
    versions = sample.model_versions()
    return version - min(versions) if versions else 0


class RolloutBuffer:
    def __init__(
        self,
        *,
        groups_per_step: int,
        max_staleness: int,
        stale_policy: str = "drop",
        version: int = 0,
        on_reject: Callable[[Group], None] | None = None,
    ):
        if stale_policy not in STALE_POLICIES:
            raise ValueError(f"rollout.stale_policy={stale_policy!r}: use one of {STALE_POLICIES}")
        self.groups_per_step, self.max_staleness = groups_per_step, max_staleness
        self.stale_policy, self.version = stale_policy, version
        self.on_reject = on_reject
        self._groups: collections.deque[Group] = collections.deque()
        self._changed = asyncio.Condition()
        self.delivered: dict[str, int] = {}  # group id -> version it was delivered at
        self.dropped: dict[str, str] = {}  # group id -> reason
        self.requeued = 0
        self.backpressure_waits, self.backpressure_s, self.trainer_wait_s = 0, 0.0, 0.0
        self._staleness: list[int] = []  # of every delivered sample

    # -- versions and admission --------------------------------------------------------------------

    async def set_version(self, version: int) -> None:
        """The policy version now served (and trained on): opens new rounds for generation."""
        async with self._changed:
            self.version = version
            self._changed.notify_all()

    def may_start(self, round_index: int) -> bool:
        return round_index <= self.version + self.max_staleness

    async def wait_to_start(self, round_index: int) -> None:
        """Block generation until round `round_index` is admitted (counted as back-pressure)."""
        async with self._changed:
            if self.may_start(round_index):
                return
            self.backpressure_waits += 1
            start = time.perf_counter()
            await self._changed.wait_for(lambda: self.may_start(round_index))
            self.backpressure_s += time.perf_counter() - start

    # -- producer side -----------------------------------------------------------------------------

    async def put(self, group: Group) -> None:
        async with self._changed:
            self._groups.append(group)
            self._changed.notify_all()

    def drop(self, group_id: str, reason: str) -> None:
        """Record that `group_id` will never reach the trainer, and why."""
        assert group_id not in self.dropped and group_id not in self.delivered, f"group {group_id} settled twice"
        self.dropped[group_id] = reason

    # -- consumer side -----------------------------------------------------------------------------

    async def get_batch(self, n_groups: int, version: int | None = None) -> list[Group]:
        """The next `n_groups` groups within the staleness bound of `version`, the trainer version
        that consumes them (default: the version last set; the driver asks for a step's batch while
        the step before trains), oldest first; waits for them."""
        version = self.version if version is None else version
        if n_groups < 1:
            raise ValueError(f"get_batch(n_groups={n_groups}): ask for at least one group")
        batch: list[Group] = []
        start = time.perf_counter()
        async with self._changed:
            while len(batch) < n_groups:
                await self._changed.wait_for(lambda: bool(self._groups))
                group = self._groups.popleft()
                worst = max(staleness(s, version) for s in group)
                if worst > self.max_staleness:
                    self._reject_stale(group)
                    continue
                batch.append(group)
        self.trainer_wait_s += time.perf_counter() - start
        for group in batch:
            gid = group[0].group_id
            assert gid not in self.delivered and gid not in self.dropped, f"group {gid} settled twice"
            self.delivered[gid] = version
            self._staleness.extend(staleness(s, version) for s in group)
        return batch

    def _reject_stale(self, group: Group) -> None:
        if self.stale_policy == "requeue":
            self.requeued += 1
        else:
            self.drop(group[0].group_id, "stale")
        if self.on_reject is not None:
            self.on_reject(group)

    # -- run checkpoints -----------------------------------------------------------------------------

    def snapshot(self) -> dict:
        """JSON-safe: the completed groups waiting for the trainer, and the ledger."""
        return {
            "queued": [[s.to_dict() for s in group] for group in self._groups],
            "delivered": dict(self.delivered),
            "dropped": dict(self.dropped),
            "requeued": self.requeued,
        }

    def restore(self, state: dict) -> None:
        """Take `snapshot()`'s state (on a fresh buffer, before generation starts)."""
        self._groups.extend([Sample.from_dict(s) for s in group] for group in state["queued"])
        self.delivered.update(state["delivered"])
        self.dropped.update(state["dropped"])
        self.requeued = state["requeued"]

    # -- reporting ---------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._groups)

    def queued_ids(self) -> set[str]:
        return {group[0].group_id for group in self._groups}

    def settled_ids(self) -> set[str]:
        """Group ids no longer generating: delivered, dropped or queued."""
        return set(self.delivered) | set(self.dropped) | self.queued_ids()

    def accounting(self) -> dict[str, int]:
        reasons = collections.Counter(self.dropped.values())
        return {
            "delivered": len(self.delivered),
            "dropped": len(self.dropped),
            "requeued": self.requeued,
            **{f"dropped_{reason}": count for reason, count in sorted(reasons.items())},
        }

    def metrics(self) -> dict[str, float]:
        seen = self._staleness or [0]
        return {
            "buffer/queue_groups": len(self._groups),
            "buffer/staleness_mean": sum(seen) / len(seen),
            "buffer/staleness_max": max(seen),
            "buffer/trainer_wait_s": self.trainer_wait_s,
            "buffer/backpressure_waits": self.backpressure_waits,
            "buffer/backpressure_s": self.backpressure_s,
            **{f"buffer/{k}": v for k, v in self.accounting().items()},
        }
