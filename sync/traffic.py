"""Bytes this process moved over the sync's links, counted where each transfer is started.

`SENT[link]` / `RECEIVED[link]`, links: "broadcast" (a weight-update group: its rank 0 sends a
bucket's bytes once, every other member receives them; `sync.group`) and "funnel" (`sync.pipeline`,
point to point between trainer ranks). The export's gathers count in
`parallel.gathers.GATHER_BYTES`. Per process, never reset: read a `snapshot()` before and after.
`moe-rl bench sync` reports them per trainer rank and per engine rank, against `moe-rl plan`'s model.
"""

from __future__ import annotations

from collections import Counter

SENT: Counter[str] = Counter()
RECEIVED: Counter[str] = Counter()


def count(link: str, sent: int = 0, received: int = 0) -> None:
    SENT[link] += sent
    RECEIVED[link] += received


def snapshot() -> dict[str, dict[str, int]]:
    """{"sent": {link: bytes}, "received": {link: bytes}} so far."""
    return {"sent": dict(SENT), "received": dict(RECEIVED)}


def since(before: dict[str, dict[str, int]], now: dict[str, dict[str, int]] | None = None) -> dict[str, dict[str, int]]:
    """What moved between `before` and `now` (`snapshot()`s; `now` defaults to this moment)."""
    now = now or snapshot()
    return {
        way: {link: n - before[way].get(link, 0) for link, n in now[way].items() if n - before[way].get(link, 0)}
        for way in ("sent", "received")
    }
