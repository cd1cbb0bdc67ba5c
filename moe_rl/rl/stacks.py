"""Every process's Python stacks on demand: what `moe-rl stacks RUN_DIR` prints, and what the
driver saves when a trainer call misses its deadline.

The driver lists the run's processes in `RUN_DIR/processes.json` (name, host, pid, where its dump
goes) each time it starts them. Each moe-rl process registers `faulthandler` on SIGUSR2 (the
driver, the trainer ranks and the rollout worker into `RUN_DIR/stacks/<name>.txt`, embedded
engines into their log), so a dump needs no cooperation from a process stuck in a collective or
holding the GIL in C. With py-spy on the PATH, `py-spy dump` reads any process instead, SGLang's
included. Processes on other nodes are dumped by running the command there (the run directory is
shared).
"""

from __future__ import annotations

import faulthandler
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

PROCESSES_FILE = "processes.json"
STACKS_DIR = "stacks"
DUMP_SIGNAL = signal.SIGUSR2


@dataclass(frozen=True)
class RunProcess:
    name: str
    host: str
    pid: int
    dump_file: str | None
    """Where its SIGUSR2 dump goes; None: it has no handler (SGLang), py-spy only."""


def stack_file(run_dir: str | Path, name: str) -> Path:
    return Path(run_dir) / STACKS_DIR / f"{name.replace(' ', '_')}.txt"


def enable_stack_dumps(run_dir: str | Path, name: str) -> RunProcess:
    """In the calling process: SIGUSR2 appends every thread's stack to its stack file."""
    path = stack_file(run_dir, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    faulthandler.register(DUMP_SIGNAL, file=open(path, "a"), all_threads=True)  # kept open: the handler writes to it
    return RunProcess(name, socket.gethostname(), os.getpid(), str(path))


def record_processes(run_dir: str | Path, processes: list[RunProcess]) -> None:
    path = Path(run_dir) / PROCESSES_FILE
    path.with_suffix(".tmp").write_text(json.dumps([asdict(p) for p in processes], indent=1))
    path.with_suffix(".tmp").rename(path)


def forget_processes(run_dir: str | Path) -> None:
    (Path(run_dir) / PROCESSES_FILE).unlink(missing_ok=True)


def read_processes(run_dir: str | Path) -> list[RunProcess]:
    path = Path(run_dir) / PROCESSES_FILE
    if not path.is_file():
        raise ValueError(f"{str(path)!r} not found: is {str(run_dir)!r} the output_dir of a running RL job?")
    return [RunProcess(**p) for p in json.loads(path.read_text())]


def dump_stacks(run_dir: str | Path, names: set[str] | None = None, wait_s: float = 5.0) -> str:
    """The stacks of the run's processes on this host (`names`: only those), as text."""
    here, py_spy = socket.gethostname(), shutil.which("py-spy")
    parts = []
    for proc in read_processes(run_dir):
        if names is not None and proc.name not in names:
            continue
        title = f"=== {proc.name} (pid {proc.pid} on {proc.host})"
        if proc.host != here:
            parts.append(f"{title}: on another node; run `moe-rl stacks {run_dir}` there")
        elif not psutil.pid_exists(proc.pid):
            parts.append(f"{title}: not running")
        elif py_spy is not None:
            done = subprocess.run([py_spy, "dump", "--pid", str(proc.pid)], capture_output=True, text=True)
            parts.append(f"{title}\n{done.stdout or done.stderr}")
        elif proc.dump_file is None:
            parts.append(f"{title}: no stack handler (install py-spy to read it)")
        else:
            parts.append(f"{title}\n{_signal_dump(proc, wait_s)}")
    return "\n".join(parts)


def save_stacks(run_dir: str | Path, prefix: str, file_name: str, header: str) -> Path | None:
    """The stacks of the processes whose names start with `prefix`, into `RUN_DIR/stacks/file_name`
    after `header`; None when this start's processes were not recorded yet."""
    if not (Path(run_dir) / PROCESSES_FILE).is_file():
        return None
    names = {p.name for p in read_processes(run_dir) if p.name.startswith(prefix)}
    path = Path(run_dir) / STACKS_DIR / file_name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{header}\n\n{dump_stacks(run_dir, names)}\n")
    return path


def _signal_dump(proc: RunProcess, wait_s: float) -> str:
    """SIGUSR2 to `proc`; what its handler appended to its dump file. A stopped process (SIGSTOP)
    or one that died meanwhile writes nothing: said so after `wait_s`."""
    path = Path(proc.dump_file)
    before = path.stat().st_size if path.exists() else 0
    os.kill(proc.pid, DUMP_SIGNAL)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        size = path.stat().st_size if path.exists() else 0
        if size > before:
            time.sleep(0.2)  # the handler writes thread by thread
            with open(path, "rb") as f:
                f.seek(before)
                return f.read().decode(errors="replace")
        time.sleep(0.05)
    return f"(no dump within {wait_s:g} s: the process is stopped or not answering signals)"
