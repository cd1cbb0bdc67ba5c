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

Why not a plain thread pool: a thread cannot be killed, so a pool thread stuck in a reward would be
lost to the pool for good, and enough stuck calls would starve every later one. Here a call holds
one of `workers` slots while it runs and gives it back when it returns or times out. Calls run on
`_Threads`: a thread that finished its call waits, idle, for the next; a stuck one stays with its
call (a daemon, it ends with the process) and later calls get fresh threads. The async path
(`score`, the rollout loop) and the blocking path (`score_blocking`, other threads) keep separate
slots, `workers` each: their callers never wait on one another. A thread per call would be simpler,
but `Thread.start` waits for the new thread's first run: on the rollout worker's core, which an
engine keeps busy, that wait was ~10% of the worker's time (py-spy, the async bench).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
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
        self._threads = _Threads(f"reward-{prefix}")

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
        """End the idle threads; a call still running keeps its daemon thread until it returns (or
        the process ends)."""
        self._threads.close()

    def _start(self, text: str, answer: Any, sample: Any) -> tuple[concurrent.futures.Future, threading.Thread]:
        return self._threads.submit(lambda: float(self.fn(text, answer, sample)))

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


class _Threads:
    """Daemon threads that run one call at a time and then wait, idle, for the next (module
    docstring). A thread whose call never returns is never idle again: the next call starts a
    fresh thread, so a stuck call costs its thread and nothing else."""

    def __init__(self, name: str):
        self.name = name
        self._idle: list[tuple[queue.SimpleQueue, threading.Thread]] = []
        self._lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        """End every idle thread now, and every busy one when its call returns."""
        with self._lock:
            self._closed, idle, self._idle = True, self._idle, []
        for inbox, _ in idle:
            inbox.put(None)

    def submit(self, fn: Callable[[], Any]) -> tuple[concurrent.futures.Future, threading.Thread]:
        """Run `fn` on an idle thread (or a new one); its future and the thread running it."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            worker = self._idle.pop() if self._idle else None
        if worker is None:
            inbox: queue.SimpleQueue = queue.SimpleQueue()
            worker = (inbox, threading.Thread(target=self._serve, args=(inbox,), name=self.name, daemon=True))
            worker[1].start()
        worker[0].put((fn, future))
        return future, worker[1]

    def _serve(self, inbox: queue.SimpleQueue) -> None:
        me = (inbox, threading.current_thread())
        while (call := inbox.get()) is not None:  # None: closed
            fn, future = call
            ran = future.set_running_or_notify_cancel()  # False: cancelled before it ran
            result = error = None
            if ran:
                try:
                    result = fn()
                except BaseException as raised:  # everything goes to the waiter
                    error = raised
            with self._lock:  # idle again before the waiter hears: its next call may come here
                if self._closed:
                    inbox.put(None)
                else:
                    self._idle.append(me)
            if ran and error is not None:
                future.set_exception(error)
            elif ran:
                future.set_result(result)
