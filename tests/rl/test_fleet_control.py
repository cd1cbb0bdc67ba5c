"""The engine fleet's control channel (`moe_rl.rl.control`) without a run: the request and answer
files, the command's errors when no driver answers, bad input refused before anything is written,
and the driver's refusals (`moe_rl.rl.fleet`) that need no engine. The real driver answering is
tests/rl/test_engine_fleet.py."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest

from moe_rl.cli import main
from moe_rl.rl.control import ControlChannel, DriverUnavailable, FleetAnswer, FleetRequest, send
from moe_rl.rl.fleet import EngineFleet


@pytest.fixture
def run_dir(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def test_request_validation_names_the_field():
    with pytest.raises(ValueError, match="N: engines to add must be an integer >= 1, got 0"):
        FleetRequest("add", count=0)
    with pytest.raises(ValueError, match="NAME: 'worker-1' is not an engine name"):
        FleetRequest("remove", name="worker-1")
    with pytest.raises(ValueError, match="action: 'grow'"):
        FleetRequest("grow")
    assert FleetRequest("list").id < FleetRequest("list").id  # time-ordered


def test_request_and_answers_round_trip(run_dir):
    channel = ControlChannel(run_dir)
    channel.open()
    accepted, result = [], {}
    request = FleetRequest("add", count=2)
    command = threading.Thread(target=lambda: result.update(answer=send(run_dir, request, 30, accepted.append)))
    command.start()
    taken = []
    while not taken:
        taken = channel.take()
    assert taken == [request]  # same fields and id (the file's name)
    assert not list((run_dir / "control" / "requests").iterdir())  # deleted once read
    channel.answer(FleetAnswer(request.id, "accepted", "starting engine-2, engine-3"))
    while not accepted:  # the command saw it (it polls every 0.2 s)
        command.join(0.01)
    done = FleetAnswer(request.id, "done", "engine-2, engine-3 serve", [{"name": "engine-2"}], 4, 9.5)
    channel.answer(done)
    command.join()
    assert [a.message for a in accepted] == ["starting engine-2, engine-3"]
    assert result["answer"] == done
    channel.close()
    assert not (run_dir / "control" / "driver.json").exists()


def test_malformed_request_is_answered(run_dir):
    channel = ControlChannel(run_dir)
    channel.open()
    (channel.requests / "1-bad.json").write_text(json.dumps({"action": "add", "count": -1}))
    (channel.requests / "2-junk.json").write_text("{")
    taken = channel.take()
    assert [t[0] for t in taken] == ["1-bad", "2-junk"]
    assert "N: engines to add" in str(taken[0][1]) and "not JSON" in str(taken[1][1])


def test_no_driver(run_dir, capsys):
    # the run never started (or ended): no driver.json
    with pytest.raises(DriverUnavailable, match="driver.json is absent"):
        send(run_dir, FleetRequest("list"), 5)
    # a driver that crashed on this host
    channel = ControlChannel(run_dir)
    channel.open()
    driver = json.loads((channel.root / "driver.json").read_text())
    (channel.root / "driver.json").write_text(json.dumps({**driver, "pid": 2**22 + 1}))
    with pytest.raises(DriverUnavailable, match="is gone: the run crashed or was killed"):
        send(run_dir, FleetRequest("list"), 5)
    # a driver that is alive but never reads: the request is withdrawn after the timeout
    channel.open()
    with pytest.raises(DriverUnavailable, match="no driver took the request within 0 s"):
        send(run_dir, FleetRequest("list"), 0.3)
    assert not list(channel.requests.iterdir())
    # the command: exit 1 and the reason; bad input refused before a request is written
    assert main(["engines", "list", str(run_dir), "--timeout", "0.3"]) == 1
    assert "no driver took the request" in capsys.readouterr().err
    assert main(["engines", "add", str(run_dir), "0"]) == 2
    assert main(["engines", "remove", str(run_dir / "elsewhere"), "engine-1"]) == 2
    assert "RUN_DIR: " in capsys.readouterr().err
    assert not list(channel.requests.iterdir())


class _Cluster:
    """What `EngineFleet` reads of an `RLCluster`, for refusals that need no engine: engine-0 live,
    engine-1 dead and restarting."""

    def __init__(self, run_dir, colocate=False):
        self.run_dir, self.version = run_dir, 3
        self.config = SimpleNamespace(rl=SimpleNamespace(colocate=colocate), cpu_pools=None)
        self.servers, self.restarting = {0: object(), 1: object()}, {1: object()}

    def engine_states(self):
        idle = {"in_flight": 0, "served": 0, "versions": None, "removed": False}
        return [{**idle, "live": True}, {**idle, "live": False}]


def _refusals(run_dir, cluster, requests: list[dict]) -> list[str]:
    fleet = EngineFleet(cluster)
    for i, body in enumerate(requests):
        (fleet.channel.requests / f"{i}.json").write_text(json.dumps(body))
    fleet.poll()
    answers = [json.loads((fleet.channel.answers / f"{i}.json").read_text()) for i in range(len(requests))]
    assert {a["state"] for a in answers} == {"failed"}
    return [a["message"] for a in answers]


def test_the_driver_refuses_what_it_cannot_do(run_dir):
    refused = _refusals(
        run_dir,
        _Cluster(run_dir),
        [
            {"action": "remove", "name": "engine-0"},
            {"action": "remove", "name": "engine-1"},
            {"action": "remove", "name": "engine-7"},
            {"action": "add", "count": 0},
        ],
    )
    assert refused == [
        "NAME: engine-0 is the last live engine: add one first (`moe-rl engines add RUN_DIR 1`)",
        "NAME: engine-1 is not live (restarting): remove it once it serves again",
        "NAME: engine-7 is not an engine of this run (engines: engine-0, engine-1)",
        "N: engines to add must be an integer >= 1, got 0",
    ]
    colocated = _refusals(run_dir, _Cluster(run_dir, colocate=True), [{"action": "add", "count": 1}])
    assert colocated == ["rl.colocate: colocated engines live on the trainer's GPUs; their number is fixed"]
