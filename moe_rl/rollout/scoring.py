"""`RewardScorer`: every reward call of a run goes through it, so no reward can stop the run.

A reward (`"math"`, a task's own, or a user's `package.module:function`) is plain Python that
may raise or hang. The scorer runs each call on its own daemon thread, off the event loop, and
waits at most `timeout_s` for it:
- it returns the reward as a float;
- a reward that raises (or returns something `float()` refuses) scores 0.0, counted
  `{prefix}/reward_errors`;
- one still running after `timeout_s` scores 0.0, counted `{prefix}/reward_timeouts`; so does one
  that raises `TimeoutError` itself (the math grader past its own limit).
The first error and the first timeout are logged as warnings with the reward's name and a
traceback (for a timeout: where the reward's thread is stuck); later ones are only counted.

Why a thread per call: a thread cannot be killed, so a pool thread stuck in a reward would be lost
to the pool for good, and enough stuck calls would starve every later one. Here a call holds one
of `workers` slots while it runs and gives it back when it returns or times out; a stuck thread
is abandoned (a daemon, it ends with the process) and later calls start fresh ones. The async
path (`score`, the rollout loop) and the blocking path (`score_blocking`, other threads) keep
separate slots, `workers` each: their callers never wait on one another. A thread start costs
~50 us, nothing next to a reward.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import sys
import threading
import traceback
from typing import Any, Callable

log = logging.getLogger(__name__)


class RewardScorer:
    """Runs a reward function off the event loop with a time limit; never raises."""

    def __init__(self, fn: Callable[..., Any], *, timeout_s: float, workers: int, prefix: str = "rollout"):
        if timeout_s <= 0 or workers < 1:
            raise ValueError(f"RewardScorer: timeout_s={timeout_s} must be > 0 and workers={workers} >= 1")
        self.fn, self.timeout_s, self.prefix = fn, timeout_s, prefix
        self.name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
        self.errors = self.timeouts = 0
        self._count_lock = threading.Lock()
        self._async_slots = asyncio.Semaphore(workers)
        self._thread_slots = threading.Semaphore(workers)

    async def score(self, text: str, answer: Any, sample: Any) -> float:
        """The reward of `text`; 0.0 (counted) when the reward raises or runs past `timeout_s`."""
        async with self._async_slots:
            future, thread = self._start(text, answer, sample)
            try:
                return await asyncio.wait_for(asyncio.wrap_future(future), self.timeout_s)
            except TimeoutError as error:  # asyncio.TimeoutError is TimeoutError (3.11)
                return self._timed_out(thread, error if future.done() else None)
            except Exception as error:
                return self._failed(error)

    def score_blocking(self, text: str, answer: Any, sample: Any) -> float:
        """`score` for a caller on a plain thread (not on an event loop): blocks at most `timeout_s`
        once a slot is free."""
        with self._thread_slots:
            future, thread = self._start(text, answer, sample)
            try:
                return future.result(timeout=self.timeout_s)
            except TimeoutError as error:  # concurrent.futures.TimeoutError is TimeoutError (3.11)
                return self._timed_out(thread, error if future.done() else None)
            except Exception as error:
                return self._failed(error)

    def metrics(self) -> dict[str, float]:
        """Calls that scored 0 for an error or a timeout, since the scorer was made."""
        return {f"{self.prefix}/reward_errors": self.errors, f"{self.prefix}/reward_timeouts": self.timeouts}

    def close(self) -> None:
        """Nothing to release: a call still running is a daemon thread that ends with the process."""

    def _start(self, text: str, answer: Any, sample: Any) -> tuple[concurrent.futures.Future, threading.Thread]:
        future: concurrent.futures.Future = concurrent.futures.Future()

        def call() -> None:
            if not future.set_running_or_notify_cancel():  # cancelled before the thread ran
                return
            try:
                future.set_result(float(self.fn(text, answer, sample)))
            except BaseException as error:  # the thread's end: everything goes to the waiter
                future.set_exception(error)

        thread = threading.Thread(target=call, name=f"reward-{self.prefix}", daemon=True)
        thread.start()
        return future, thread

    def _failed(self, error: BaseException) -> float:
        with self._count_lock:
            self.errors += 1
            first = self.errors == 1
        if first:
            log.warning(
                "reward %s raised %r: it scores 0; later errors are counted in %s/reward_errors, not logged",
                self.name,
                error,
                self.prefix,
                exc_info=error,
            )
        return 0.0

    def _timed_out(self, thread: threading.Thread, error: BaseException | None) -> float:
        """`error`: the reward's own TimeoutError; None when it is still running (abandoned)."""
        with self._count_lock:
            self.timeouts += 1
            first = self.timeouts == 1
        if first:
            frame = sys._current_frames().get(thread.ident) if error is None else None
            where = "".join(traceback.format_stack(frame)) if frame is not None else "(it has returned)"
            log.warning(
                "reward %s ran past its time limit (rollout.reward_timeout_s=%s s, or its own): it scores 0; later "
                "timeouts are counted in %s/reward_timeouts, not logged. %s",
                self.name,
                self.timeout_s,
                self.prefix,
                f"It is stuck at:\n{where}" if error is None else "",
                exc_info=error,
            )
        return 0.0
