"""Calling every engine at once from synchronous trainer code.

The endpoints' methods are coroutines; the trainer's export loop is blocking code (it runs
collectives). `EngineSet` keeps one asyncio event loop on a daemon thread, so engine calls
proceed (concurrently, one per engine) while the calling thread packs or broadcasts.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from concurrent.futures import Future
from typing import Any, Callable, Coroutine

from sync.engine_api import EngineEndpoint


class SyncError(RuntimeError):
    """A weight update failed. `engine` / `bucket` name the first failure (None if not one);
    `dropped` names the engines the sender dropped as dead on the way out (see `WeightSender`)."""

    def __init__(self, message: str, engine: str | None = None, bucket: int | None = None):
        super().__init__(message)
        self.engine, self.bucket = engine, bucket
        self.dropped: list[str] = []


class EngineSet:
    def __init__(self, engines: list[EngineEndpoint], timeout_s: float):
        for engine in engines:
            if not isinstance(engine, EngineEndpoint):
                raise ValueError(f"engines: {engine!r} does not implement sync.engine_api.EngineEndpoint")
        names = [e.name for e in engines]
        if len(set(names)) != len(names):
            raise ValueError(f"engines: names must be unique, got {names}")
        self.engines = list(engines)
        self.timeout_s = timeout_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sync-engines", daemon=True)
        self._thread.start()

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.engines]

    def submit(self, call: Callable[[EngineEndpoint], Coroutine[Any, Any, Any]]) -> dict[str, Future]:
        """Start `call(engine)` on every engine; returns a future per engine name."""
        return {
            e.name: asyncio.run_coroutine_threadsafe(asyncio.wait_for(call(e), self.timeout_s), self._loop)
            for e in self.engines
        }

    def wait(self, futures: dict[str, Future]) -> dict[str, BaseException]:
        """Wait for every future; returns the failures by engine name (empty: all succeeded)."""
        errors = {}
        for name, future in futures.items():
            try:
                future.result(self.timeout_s + 5)
            except BaseException as error:  # noqa: BLE001 - reported per engine, never swallowed
                errors[name] = error
        return errors

    def call(self, call: Callable[[EngineEndpoint], Coroutine[Any, Any, Any]]) -> dict[str, BaseException]:
        """`submit` then `wait`."""
        return self.wait(self.submit(call))

    def results(self, call: Callable[[EngineEndpoint], Coroutine[Any, Any, Any]], what: str) -> dict[str, Any]:
        """`call` on every engine; returns each engine's result, or raises SyncError naming `what`."""
        futures = self.submit(call)
        if failed := self.wait(futures):
            raise SyncError(f"{what} failed: {describe(failed)}", engine=next(iter(failed)))
        return {name: future.result() for name, future in futures.items()}

    def drop(self, names: set[str]) -> None:
        self.engines = [e for e in self.engines if e.name not in names]

    def add(self, engine: EngineEndpoint) -> None:
        """Add `engine`, replacing a member of the same name (a restarted engine)."""
        if not isinstance(engine, EngineEndpoint):
            raise ValueError(f"engine: {engine!r} does not implement sync.engine_api.EngineEndpoint")
        self.drop({engine.name})
        self.engines.append(engine)

    def subset(self, names: set[str]) -> "EngineSet":
        """A view of some members sharing this set's event loop (never `close` a subset)."""
        view = copy.copy(self)
        view.engines = [e for e in self.engines if e.name in names]
        return view

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)


def describe(errors: dict[str, BaseException]) -> str:
    return "; ".join(f"{name}: {type(e).__name__}: {e}" for name, e in errors.items())


async def require_health(engine: EngineEndpoint) -> None:
    """Raises ConnectionError when `engine` does not answer `/health`: how a failed call is told
    from a dead engine."""
    if not await engine.health():
        raise ConnectionError(f"{engine.name} does not answer /health")
