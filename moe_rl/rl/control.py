"""The engine fleet's control channel: how `moe-rl engines` reaches a running RL driver.

Files in the run directory, so the command works from any node that sees RUN_DIR (a shared file
system) and the driver opens no port:

    RUN_DIR/control/
        driver.json          {"pid", "host", "started"}: written once the driver's cluster is up,
                             removed when it closes
        requests/<id>.json   one `FleetRequest`, written by the command (tmp + rename)
        answers/<id>.json    its `FleetAnswer`, rewritten by the driver (tmp + rename) as it advances

A request's life, as numbered steps:
  1. the command validates its input (`FleetRequest`), checks `driver.json` (absent, or naming a
     process gone on this host: an error saying what to check) and writes the request atomically;
  2. the driver reads `requests/` while it waits for a batch and after each weight sync
     (`RLCluster.recover`, at most every `POLL_S`), deletes each request it reads and answers
     `state: "accepted"`, or `"failed"` with an error that names the field and the fix;
  3. it acts (`moe_rl.rl.fleet`) and answers `"done"` (or `"failed"`) with the fleet as it is then:
     an add once its engines serve, a remove once the engine's process stopped, a list at once;
  4. the command prints the answer; with none within its timeout it withdraws a request that no
     driver took (deletes the file, so a driver started later never acts on it) and says what to check.
A driver reads requests in the order of their ids (time-ordered) and acts on one at a time.
This module is plain files and JSON: the command imports it without Ray.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil

CONTROL_DIR = "control"
POLL_S = 1.0
"""How often the driver reads `requests/` (it polls every 0.2 s while waiting; a listing costs a
metadata round trip on a shared file system)."""
ACTIONS = ("add", "remove", "list")
STATES = ("accepted", "done", "failed")
_NAME = re.compile(r"engine-\d+")


@dataclass(frozen=True)
class FleetRequest:
    """One `moe-rl engines` request (`requests/<id>.json`)."""

    action: str
    """"add", "remove" or "list"."""
    count: int = 0
    """add: how many engines to start (>= 1)."""
    name: str = ""
    """remove: the engine, as `moe_rl.engine.client.engine_name` gives it (`engine-3`)."""
    id: str = field(default_factory=lambda: f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}")
    """Unique and time-ordered: the driver reads requests in this order."""

    def __post_init__(self):
        if self.action not in ACTIONS:
            raise ValueError(f"action: {self.action!r} is not one of {', '.join(ACTIONS)}")
        if self.action == "add" and (not isinstance(self.count, int) or self.count < 1):
            raise ValueError(f"N: engines to add must be an integer >= 1, got {self.count!r}")
        if self.action == "remove" and not _NAME.fullmatch(str(self.name)):
            raise ValueError(
                f"NAME: {self.name!r} is not an engine name: give one as `moe-rl engines list RUN_DIR` shows "
                "it, e.g. engine-1"
            )


@dataclass(frozen=True)
class FleetAnswer:
    """The driver's answer to one request (`answers/<id>.json`)."""

    id: str
    state: str
    """"accepted" (being done), "done" or "failed"."""
    message: str = ""
    """What happened (done), or the error with its fix (failed)."""
    engines: list[dict] = field(default_factory=list)
    """The fleet then: per engine {name, state, in_flight, served, versions}."""
    version: int | None = None
    """The weight version committed on the engines then."""
    seconds: float | None = None
    """add: from the request's arrival until its engines got work; remove: until its process stopped."""

    @property
    def final(self) -> bool:
        return self.state != "accepted"


class ControlChannel:
    """The driver's end: `open` announces the driver, `take` reads new requests, `answer` writes."""

    def __init__(self, run_dir: Path):
        self.root = Path(run_dir) / CONTROL_DIR
        self.requests, self.answers = self.root / "requests", self.root / "answers"

    def open(self) -> None:
        self.requests.mkdir(parents=True, exist_ok=True)
        self.answers.mkdir(parents=True, exist_ok=True)
        driver = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        _write_atomic(self.root / "driver.json", driver)

    def take(self) -> list[FleetRequest | tuple[str, ValueError]]:
        """The requests written since the last call, oldest first, each deleted once read; a
        malformed one comes as (its id, the error) so that it can be answered."""
        taken = []
        for path in sorted(self.requests.glob("*.json")):
            try:
                body = json.loads(path.read_text())
                path.unlink()
            except FileNotFoundError:  # withdrawn by its command meanwhile
                continue
            except json.JSONDecodeError as error:
                path.unlink(missing_ok=True)
                taken.append((path.stem, ValueError(f"request {path.name}: not JSON ({error})")))
                continue
            try:
                taken.append(FleetRequest(**{**body, "id": path.stem}))
            except (TypeError, ValueError) as error:
                taken.append((path.stem, ValueError(str(error))))
        return taken

    def answer(self, answer: FleetAnswer) -> None:
        _write_atomic(self.answers / f"{answer.id}.json", dataclasses.asdict(answer))

    def close(self) -> None:
        (self.root / "driver.json").unlink(missing_ok=True)


class DriverUnavailable(RuntimeError):
    """No driver answered a request (the message says what to check)."""


def send(run_dir: str | Path, request: FleetRequest, timeout_s: float, on_accepted=None) -> FleetAnswer:
    """The command's end (steps 1 and 4): write `request`, wait for the driver's final answer.
    `on_accepted(answer)` is called once the driver took it. Raises DriverUnavailable."""
    root = Path(run_dir) / CONTROL_DIR
    driver = _running_driver(Path(run_dir))
    path = root / "requests" / f"{request.id}.json"
    answer_path = root / "answers" / f"{request.id}.json"
    _write_atomic(path, {"action": request.action, "count": request.count, "name": request.name})
    deadline, accepted = time.monotonic() + timeout_s, False
    while time.monotonic() < deadline:
        answer = _read_answer(answer_path)
        if answer is not None and answer.final:
            return answer
        if answer is not None and not accepted:
            accepted = True
            if on_accepted is not None:
                on_accepted(answer)
        time.sleep(0.2)
    where = f"the driver (pid {driver['pid']} on {driver['host']})"
    try:
        path.unlink()  # withdrawn: no driver acts on it later
    except FileNotFoundError:  # taken just now, or long ago without an answer yet
        raise DriverUnavailable(
            f"{where} took request {request.id} but has not finished it within {timeout_s:.0f} s; it goes on: "
            f"see `moe-rl engines list {run_dir}`, {answer_path} and the engines' logs (RUN_DIR/engine-N.log)"
        ) from None
    raise DriverUnavailable(
        f"no driver took the request within {timeout_s:.0f} s (it was withdrawn); {root / 'driver.json'} names "
        f"{where}. The driver reads {root / 'requests'} while it waits for a batch and after each weight "
        "sync: check that the run is alive, that this node sees the same RUN_DIR (a shared file system), "
        "or give a --timeout longer than a training step"
    )


def _running_driver(run_dir: Path) -> dict:
    """driver.json, when a driver may still be reading requests; else DriverUnavailable."""
    path = run_dir / CONTROL_DIR / "driver.json"
    if not (run_dir / "config.json").exists():
        raise ValueError(f"RUN_DIR: {run_dir} holds no config.json: give the output_dir of a `moe-rl train` run")
    try:
        driver = json.loads(path.read_text())
    except FileNotFoundError:
        raise DriverUnavailable(
            f"no driver is running for {run_dir}: {path} is absent (a driver writes it once its engines are up "
            "and removes it when the run ends): check that `moe-rl train` runs with this output_dir and has "
            "started its engines"
        ) from None
    if driver["host"] == socket.gethostname() and not psutil.pid_exists(driver["pid"]):
        raise DriverUnavailable(
            f"the driver that wrote {path} (pid {driver['pid']} on {driver['host']}) is gone: the run crashed "
            "or was killed; see its log, and `moe-rl train --resume` to continue it"
        )
    return driver


def _read_answer(path: Path) -> FleetAnswer | None:
    try:
        return FleetAnswer(**json.loads(path.read_text()))
    except FileNotFoundError:
        return None


def _write_atomic(path: Path, body: dict) -> None:
    """Readers see the whole file or none (rename within one directory is atomic, NFS included)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(body, indent=1))
    os.replace(tmp, path)
