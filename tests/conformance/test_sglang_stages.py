"""Per-stage weight-update groups (`sync.stages`) and relay ranks (`sync.relay`) against SGLang twins
(SGLang's own weight code in real processes, `sglang_twin.py`): a trainer world of two stage
sources (stage 0's, the coordinator; stage 1's), with relays one more rank behind each (group
ranks 0 and 1; the engines from rank_offset 2), and two engines of tp 2, each of whose TP ranks
joins both stages' groups (SGLang keeps groups by `group_name`, each broadcasting from its own
rank 0, at the rank_offset and world size the client chooses)."""

from __future__ import annotations

import os
import signal

import pytest
from safetensors.torch import load_file

from parallel.world import spawn
from tests.conformance.test_sglang_sync import _assert_serves, _version

pytestmark = [pytest.mark.timeout(600), pytest.mark.world]


def _stage_rank(
    urls: list[str], weights_dir: str, script: list[tuple[int, int | None]], victim: int | None, relays: bool
) -> list:
    """Rank function: stage s's source (rank s, or 2s with relays: then rank 2s + 1 is its relay)
    owns half of the tensors (stage 0 the first half by name). For each (version, kill_after) of
    `script` every rank calls `StagedSync.update`; stage 1's source kills `victim` (a twin TP rank)
    after `kill_after` of its tensors. Returns the coordinator's outcomes ("ok", engines) /
    ("error", dropped, partial, the survivors' state), the relays' bucket counts, nothing elsewhere."""
    import requests
    import torch.distributed as dist

    from moe_rl.engine.client import EngineClient
    from sync.config import SyncConfig
    from sync.engine_set import SyncError
    from sync.stages import StagedSync

    rank = dist.get_rank()
    base = load_file(os.path.join(weights_dir, "model.safetensors"))
    names = sorted(base)
    per_stage = 2 if relays else 1
    sources = {0: 0, 1: per_stage}
    stage = rank // per_stage
    mine = [] if rank not in sources.values() else names[: len(names) // 2] if stage == 0 else names[len(names) // 2 :]
    clients = [
        EngineClient(url, kind="sglang", name=f"twin-{i}", retries=1, timeout_s=60) for i, url in enumerate(urls)
    ]
    behind = {0: [1], 1: [3]} if relays else None
    sync = StagedSync(clients, SyncConfig(bucket_bytes=16 << 10, timeout_s=60), sources, relays=behind)
    outcomes = []

    def stream(weights, kill_after):
        for i, name in enumerate(mine):
            if stage == 1 and kill_after is not None and i == kill_after:
                os.kill(victim, signal.SIGKILL)
            yield name, weights[name]

    try:
        for version, kill_after in script:
            weights = _version(base, version)
            try:
                stats = sync.update(stream(weights, kill_after), version)
                if stats is not None:
                    outcomes.append(("ok", sorted(stats.engines)))
            except SyncError as failure:  # and what the survivors look like before the retry
                # (behind a relay, a survivor may wait out the group timeout (60 s) before it answers)
                survivors = [requests.get(url + "/twin/state", timeout=180).json() for url in urls[1:]]
                paused = [(s["version"], s["paused"] is not None, s["session"]) for t in survivors for s in t]
                outcomes.append(("error", failure.dropped, sorted(sync.sender.partial), paused))
            dist.barrier()
    finally:
        sync.close()
    return outcomes if sync.relay is None else [("relayed", sync.relay.buckets)]


@pytest.mark.parametrize("relays", [False, True], ids=["stages", "stages-relays"])
def test_two_stages_reach_both_tp2_twins_bit_exact_and_commit_once(twins, model_dir, relays):  # noqa: F811
    urls = [t.url for t in twins]
    outcomes = spawn(_stage_rank, 4 if relays else 2, urls, model_dir, [(1, None), (2, None)], None, relays)
    assert outcomes[0] == [("ok", ["twin-0", "twin-1"])] * 2
    if relays:  # each relay took part in every bucket of its stage's group
        (_, first), (_, second) = outcomes[1][0], outcomes[3][0]
        assert first > 0 and second > 0 and outcomes[2] == []
    base = load_file(os.path.join(model_dir, "model.safetensors"))
    for twin in twins:
        _assert_serves(twin, _version(base, 2), "2")  # every tensor of both stages, at every TP rank
        log = twin.log()
        assert all(entry["success"] for entry in log), [e for e in log if not e["success"]]
        routes = [e["route"] for e in log]
        assert routes.count("/init_weights_update_group") == 2 and routes.count("/begin_weight_update") == 2
        for entry in log:  # the label moves only at the commit, never with a bucket of either stage
            if entry["route"] == "/update_weights_from_distributed":
                assert entry["weight_version"] is None and entry["before"] == entry["after"]
        commits = [e for e in log if e["route"] == "/update_weight_version"]
        assert [(c["before"], c["after"]) for c in commits] == [(["0", "0"], ["1", "1"]), (["1", "1"], ["2", "2"])]


@pytest.mark.parametrize("relays", [False, True], ids=["stages", "stages-relays"])
def test_rank_killed_in_the_second_stage_leaves_the_other_engine_paused(twins, model_dir, relays):  # noqa: F811
    urls = [t.url for t in twins]
    victim = twins[0].get("/twin/ranks")[1]
    script = [(1, None), (2, 3), (2, None), (3, None)]  # v2 fails mid stage 1, is retried, then v3
    base = load_file(os.path.join(model_dir, "model.safetensors"))

    outcomes = spawn(_stage_rank, 4 if relays else 2, urls, model_dir, script, victim, relays)[0]
    assert outcomes == [
        ("ok", ["twin-0", "twin-1"]),
        # partly loaded, still labelled 1, paused, no session open: it must not serve
        ("error", ["twin-0"], ["twin-1"], [("1", True, False), ("1", True, False)]),
        ("ok", ["twin-1"]),  # the retry (a fresh export) gives the live engine the full version
        ("ok", ["twin-1"]),
    ]
    assert not twins[0].process.is_alive()  # SGLang's server goes down with a scheduler
    _assert_serves(twins[1], _version(base, 3), "3")
