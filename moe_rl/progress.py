"""Progress over a job's steps: a live rich bar on a terminal, plain lines in a log file.

Under `sbatch` stdout is a file, where rich's live bar would show nothing until the end; there a
line goes out every ~5% of the steps (and at the last), so a 48 h job's log shows where it is.
"""

from __future__ import annotations

import sys
import time

from rich.progress import Progress


class StepProgress:
    """`with StepProgress("rl", total) as progress: progress.advance("reward 0.5")` once per step;
    `first`: the steps already done (a resumed run counts on from there)."""

    def __init__(self, label: str, total: int, enabled: bool = True, first: int = 0):
        self.label, self.total, self.enabled = label, total, enabled
        self.done, self.every = first, max(1, total // 20)
        self.bar = None
        if enabled and sys.stdout.isatty():
            self.bar = Progress(*Progress.get_default_columns(), "{task.fields[status]}")

    def __enter__(self) -> StepProgress:
        self.start = time.perf_counter()
        if self.bar is not None:
            self.bar.start()
            self.task = self.bar.add_task(self.label, total=self.total, completed=self.done, status="starting")
        return self

    def advance(self, status: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(self.task, advance=1, status=status)
        elif self.enabled and (self.done % self.every == 0 or self.done == self.total):
            elapsed = time.perf_counter() - self.start
            print(f"{self.label} step {self.done}/{self.total} ({elapsed:.0f} s)  {status}", flush=True)

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()
