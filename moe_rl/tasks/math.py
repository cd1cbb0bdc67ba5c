"""The `"math"` reward: the final answer of a response against the reference, graded by HF
math-verify (`math_verify.parse` + `math_verify.verify`) in a child process.

What is compared:
- the prediction is the content of the last `\\boxed{...}` (nested braces allowed), given to
  math-verify as `$\\boxed{...}$`; without a box, math-verify extracts the answer from the whole
  text (LaTeX or a plain expression; "so the answer is 42." reads 42);
- the reference (a string such as "\\frac{\\sqrt{3}}{2}", "\\{1,2,3\\}", "18.90", or a number)
  is wrapped in `$...$` unless it has its own delimiters, and parsed as LaTeX or a plain expression;
- `verify` compares numerically (6 decimals: "0.5" == "\\frac12", "0.33" != "\\frac13"),
  symbolically ("1+2x" == "2x+1", "10^{3}" == "1000"), sets in any order, intervals, tuples and
  matrices; it drops units (`12 \\text{ cm}`), `^\\circ`, `\\%` and a leading `x =`. The only
  normalisation done here: `\\$` is removed, since math-verify reads no number in `$\\$18.90$`.

Why a process: math-verify bounds its own parse and verify with `signal.alarm`, which works only
in a process's main thread, and rewards run on worker threads (`moe_rl.rollout.scoring`) and in
Ray actors. `MathGrader` runs math-verify in the main thread of spawned children (a
`ProcessPoolExecutor`) with its limits on, and bounds each call from outside as well: past
`GRADE_TIMEOUT_S` the children are killed, the call raises `TimeoutError` (the reward scorer
turns it into 0) and the next call starts fresh ones. A call killed with them (another call's
timeout) is retried once on the fresh children. A child ends when its parent dies, killed or not.

Cost (measured on a shared 2-core CPU box, 2026-12-03): the first call starts the two children,
0.7-2.3 s (spawn, import moe_rl.tasks and math-verify: sympy), outside its limit. After that, round
trip to a child included, a grade takes ~1.5 ms for numbers and fractions, ~3-4 ms for roots and
expressions, ~25-35 ms for sets and intervals (max seen ~130 ms); median ~3 ms over these; a
grade math-verify has seen before (its parse cache) ~0.6 ms. In-process math-verify alone is
~0.3 ms of those cached ones: the process costs ~0.3 ms a call. Each child holds ~135 MB (RSS).
The children start without the parent's `__main__`: a "spawn" child imports it (as
`__mp_main__`), so a plain script that calls the reward without an `if __name__ == "__main__":`
guard would run again in every child, whose grades would all fail. The children run only this
module's functions, so the pool starts them while `sys.modules["__main__"]` is a bare stand-in
(`_main_hidden`; a few milliseconds per start): the reward works from any script.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing
import multiprocessing.connection
import os
import sys
import threading
import types
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable

from moe_rl.sample import Sample
from moe_rl.tasks.registry import register_reward

PARSE_TIMEOUT_S = 3
"""math-verify's own limit on one parse (whole seconds: `signal.alarm`), in the child."""
VERIFY_TIMEOUT_S = 3
"""math-verify's own limit on one comparison, in the child."""
GRADE_TIMEOUT_S = 15.0
"""The hard limit on one grade, from outside (waiting for a free child included)."""
STARTUP_TIMEOUT_S = 120.0
"""The limit on starting the children (outside any call's limit)."""


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} in `text`, braces balanced; None when there is none."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    open_at = text.find("{", start)
    if open_at < 0:
        return None
    depth = 0
    for i in range(open_at, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[open_at + 1 : i]
    return None


def prediction_text(response: str) -> str:
    """What math-verify reads of a response: its last box alone, else the whole text."""
    boxed = last_boxed(response)
    text = response if boxed is None else f"$\\boxed{{{boxed}}}$"
    return text.replace("\\$", "")


def gold_text(answer: Any) -> str:
    """What math-verify reads of a reference answer: LaTeX in `$...$` unless delimited already."""
    text = str(answer).strip().replace("\\$", "")
    return text if "$" in text or "\\boxed" in text or "\\(" in text or "\\[" in text else f"${text}$"


def _start_child() -> None:
    """A grader child's start: math-verify imported, and a thread that ends the child when the
    parent dies (a killed parent would otherwise leave it waiting on its queue for good)."""
    import math_verify  # noqa: F401  (heavy: sympy; only the grader's children load it)

    sentinel = multiprocessing.parent_process().sentinel
    threading.Thread(target=_exit_with_parent, args=(sentinel,), daemon=True).start()


def _exit_with_parent(sentinel: int) -> None:
    multiprocessing.connection.wait([sentinel])  # ready once the parent is gone
    os._exit(1)


def grade(prediction: str, gold: str) -> bool:
    """math-verify on `prediction_text` and `gold_text` outputs. Runs in the grader's child: its
    timeouts need the main thread."""
    import math_verify  # heavy (sympy); only the grader's children load it

    configs = [math_verify.LatexExtractionConfig(), math_verify.ExprExtractionConfig()]
    expected = math_verify.parse(gold, configs, parsing_timeout=PARSE_TIMEOUT_S)
    predicted = math_verify.parse(prediction, configs, parsing_timeout=PARSE_TIMEOUT_S)
    return bool(expected and predicted) and math_verify.verify(expected, predicted, timeout_seconds=VERIFY_TIMEOUT_S)


class MathGrader:
    """Runs functions in spawned child processes, each call limited to `timeout_s`; thread-safe.
    The children start on the first call (and after a kill), outside its limit."""

    def __init__(self, *, timeout_s: float = GRADE_TIMEOUT_S, processes: int = 2):
        self.timeout_s, self.processes = timeout_s, processes
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None

    def call(self, fn: Callable, *args):
        """`fn(*args)` in a child (`fn` importable by name); `TimeoutError` past `timeout_s`, when
        the children are killed."""
        for attempt in range(2):
            pool, future = self._submit(fn, args)
            try:
                done, _ = concurrent.futures.wait([future], timeout=self.timeout_s)
                if done:
                    return future.result()
            except BrokenProcessPool:  # its child was killed (another call's timeout) or crashed
                self._discard(pool)
                if attempt:
                    raise
                continue
            self._discard(pool)
            raise TimeoutError(f"{fn.__name__} ran past {self.timeout_s} s in the grader's child; killed it")

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def _submit(self, fn: Callable, args) -> tuple[concurrent.futures.ProcessPoolExecutor, concurrent.futures.Future]:
        # under the lock, so no call submits to a pool that another is shutting down
        with self._lock:
            if self._pool is None:
                self._pool = self._new_pool()
            try:
                with _main_hidden():  # a submit may start a child
                    return self._pool, self._pool.submit(fn, *args)
            except BrokenProcessPool:  # a child died since the last call: start fresh ones
                self._pool = self._new_pool()
                with _main_hidden():
                    return self._pool, self._pool.submit(fn, *args)

    def _new_pool(self) -> concurrent.futures.ProcessPoolExecutor:
        """Fresh children, up and with math-verify imported before any call's limit starts."""
        context = multiprocessing.get_context("spawn")  # no fork of a process that runs threads
        pool = concurrent.futures.ProcessPoolExecutor(self.processes, mp_context=context, initializer=_start_child)
        try:
            with _main_hidden():  # each submit may start a child
                starts = [pool.submit(os.getpid) for _ in range(self.processes)]
            for started in starts:
                started.result(timeout=STARTUP_TIMEOUT_S)
        except BaseException:
            _kill(pool)
            raise
        return pool

    def _discard(self, pool: concurrent.futures.ProcessPoolExecutor) -> None:
        """Kill `pool`'s children (a stuck one ignores everything else) unless already replaced."""
        with self._lock:
            if self._pool is not pool:
                return
            self._pool = None
        _kill(pool)


_MAIN_SWAP = threading.Lock()


@contextlib.contextmanager
def _main_hidden():
    """While children start: `__main__` is a bare module, so no child imports the parent's script
    (`multiprocessing.spawn.get_preparation_data` reads `sys.modules["__main__"]` as it starts one)."""
    with _MAIN_SWAP:  # one swap at a time: two graders' overlapping swaps would leave the stand-in
        main = sys.modules["__main__"]
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            yield
        finally:
            sys.modules["__main__"] = main


def _kill(pool: concurrent.futures.ProcessPoolExecutor) -> None:
    for process in list((pool._processes or {}).values()):  # no public kill before Python 3.14
        process.kill()
    pool.shutdown(wait=False, cancel_futures=True)


GRADER = MathGrader()
"""The module's grader, shared by every caller of the `"math"` reward."""


@register_reward("math")
def math_reward(response: str, answer: Any, sample: Sample) -> float:
    """1.0 when math-verify finds the response's final answer equal to `answer`, else 0.0;
    `TimeoutError` past `GRADE_TIMEOUT_S` (0 through the reward scorer)."""
    return float(GRADER.call(grade, prediction_text(response), gold_text(answer)))
