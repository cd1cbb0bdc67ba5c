"""Preemption: SIGTERM / SIGUSR1 stop the RL run at a safe point with a checkpoint.

SLURM sends the batch shell USR1 ahead of the time limit (`--signal=B:USR1@300`) and TERM on
`scancel` or preemption; `scripts/slurm/train.sbatch` forwards either to the driver. The first
signal asks the driver loop to write a run checkpoint at the end of the step under way (or the
next one, when that step's batch was already asked for) and to stop; `moe-rl train` then exits
`EXIT_PREEMPTED` (75, EX_TEMPFAIL: "try again"), which the sbatch script turns into a requeue
that resumes. A second signal, or `rl.stop_grace_s` after the first, exits at once: run
checkpoints are written under a temporary name and renamed when complete, so the newest complete
one stays intact.
"""

from __future__ import annotations

import logging
import signal
import threading

log = logging.getLogger(__name__)

EXIT_PREEMPTED = 75
"""`moe-rl train`'s exit status after a stop signal was honoured (EX_TEMPFAIL)."""

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequested(SystemExit):
    """Raised from the signal handler on a second signal or when the grace period ran out: the
    run exits at once, through every `finally` (processes stopped, Ray shut down)."""


class StopSignals:
    """Catches SIGTERM and SIGUSR1 while the run is in this context (main thread only; elsewhere,
    as under pytest-xdist workers' threads, it does nothing); `requested` names the first signal.
    `grace_s` None: not known yet (`moe-rl train` catches signals before the config is read); the
    grace period of a signal caught meanwhile starts at `set_grace`."""

    def __init__(self, grace_s: float | None):
        self.grace_s = grace_s
        self.requested: str | None = None
        self._previous: dict[int, object] = {}
        self._timer: threading.Timer | None = None

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def release(self) -> None:
        """Give the signals their handlers from before (idempotent)."""
        if self._timer is not None:
            self._timer.cancel()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def set_grace(self, grace_s: float) -> None:
        """The run's `rl.stop_grace_s`; a signal already caught starts its grace period now."""
        self.grace_s = grace_s
        if self.requested is not None and self._timer is None:
            self._start_grace(signal.Signals[self.requested])

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested is not None:
            raise StopRequested(128 + signum)
        self.requested = name
        log.warning(
            "%s: the run checkpoints at the end of this step and exits %d (again, or after rl.stop_grace_s: at once)",
            name,
            EXIT_PREEMPTED,
        )
        if self.grace_s is not None:
            self._start_grace(signum)

    def _start_grace(self, signum: int) -> None:
        """The grace period: the same signal again, from a timer thread (handlers run on the main thread)."""
        self._timer = threading.Timer(self.grace_s, signal.raise_signal, (signum,))
        self._timer.daemon = True
        self._timer.start()
