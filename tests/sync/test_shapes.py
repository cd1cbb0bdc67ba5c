"""`sync.shapes.make_syncer`: which `Syncer` each rank of a 2-rank gloo world holds, per setup.
Nothing is sent: the shapes' updates are tested with real engines in test_sync_stages.py,
test_sync_pipeline.py and tests/trainer/test_rl_step.py."""

from __future__ import annotations

import pytest

from parallel.world import spawn

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)


def _shapes() -> dict[str, tuple[str, str | None, bool]]:
    """Rank function: {setup: (the Syncer's class, its sender's class, pending(1))}."""
    from sync.config import AdapterSyncConfig, SyncConfig
    from sync.receiver_engine import ReceiverEngineClient
    from sync.shapes import SyncSetup, make_syncer

    engines = [ReceiverEngineClient(1, name="engine-0")]  # never contacted: nothing is opened
    config = SyncConfig(timeout_s=5)
    setups = {
        "one stage": SyncSetup(config, {0: 0}),
        "two stages": SyncSetup(config, {0: 0, 1: 1}),
        "two stages, funnel": SyncSetup(SyncConfig(timeout_s=5, stage_groups=False), {0: 0, 1: 1}),
        "adapters": SyncSetup(config, {0: 0}, adapters=AdapterSyncConfig(), peft_config={"r": 1}),
    }
    found = {}
    for what, setup in setups.items():
        syncer = make_syncer(engines, setup)
        sender = getattr(syncer, "sender", None)
        found[what] = (type(syncer).__name__, type(sender).__name__ if sender else None, syncer.pending(1))
        syncer.close()
    return found


def test_make_syncer_picks_each_ranks_part_from_the_setup():
    coordinator, other = spawn(_shapes, 2, timeout_s=120)
    assert coordinator == {
        "one stage": ("Funnel", "WeightSender", True),
        "two stages": ("StagedSync", "WeightSender", True),
        "two stages, funnel": ("Funnel", "WeightSender", True),
        "adapters": ("AdapterSync", None, True),
    }
    assert other == {  # only the coordinator decides whether an update is pending
        "one stage": ("Funnel", None, False),
        "two stages": ("StagedSync", None, False),
        "two stages, funnel": ("Funnel", None, False),
        "adapters": ("Bystander", None, False),
    }
