"""RolloutBuffer on real asyncio: admission by rounds, staleness at consumption, the group ledger."""

from __future__ import annotations

import asyncio

import pytest

from moe_rl.rollout import RolloutBuffer, RolloutConfig, staleness
from moe_rl.sample import Sample


def group(gid: str, versions: list[int], n: int = 2) -> list[Sample]:
    return [
        Sample(
            prompt_ids=[1],
            response_ids=[5] * len(versions),
            rollout_logprobs=[0.0] * len(versions),
            loss_mask=[1] * len(versions),
            weight_versions=list(versions),
            group_id=gid,
        )
        for _ in range(n)
    ]


def test_staleness_uses_the_oldest_token():
    assert staleness(group("a", [3, 5, 4])[0], version=6) == 3
    assert staleness(Sample(prompt_ids=[1]), version=6) == 0


def test_admission_holds_generation_until_the_trainer_catches_up():
    async def go():
        buffer = RolloutBuffer(groups_per_step=2, max_staleness=1)
        assert buffer.may_start(0) and buffer.may_start(1) and not buffer.may_start(2)
        waiter = asyncio.create_task(buffer.wait_to_start(2))
        await asyncio.sleep(0.05)
        assert not waiter.done() and buffer.backpressure_waits == 1
        await buffer.set_version(1)
        await asyncio.wait_for(waiter, 1)
        return buffer

    buffer = asyncio.run(go())
    assert buffer.backpressure_s >= 0.04


def test_stale_groups_are_dropped_or_requeued_and_counted():
    async def go(policy):
        rejected = []
        buffer = RolloutBuffer(groups_per_step=1, max_staleness=1, stale_policy=policy, on_reject=rejected.append)
        await buffer.set_version(3)
        await buffer.put(group("old", [1, 3]))  # staleness 2 > 1
        await buffer.put(group("ok", [2, 3]))
        batch = await buffer.get_batch(1)
        return buffer, batch, rejected

    buffer, batch, rejected = asyncio.run(go("drop"))
    assert [g[0].group_id for g in batch] == ["ok"] and [g[0].group_id for g in rejected] == ["old"]
    assert buffer.dropped == {"old": "stale"} and buffer.delivered == {"ok": 3}
    assert buffer.metrics()["buffer/staleness_max"] == 1
    buffer, batch, rejected = asyncio.run(go("requeue"))
    assert buffer.dropped == {} and buffer.requeued == 1 and [g[0].group_id for g in rejected] == ["old"]


def test_staleness_counts_against_the_consuming_version():
    """The driver asks for step v + 1's batch while version v is still the buffer's: a group one
    version behind v is two behind v + 1, so at bound 1 it is stale for that batch."""

    async def go():
        buffer = RolloutBuffer(groups_per_step=1, max_staleness=1)
        await buffer.set_version(3)
        await buffer.put(group("behind v", [2, 3]))
        await buffer.put(group("at v", [3, 3]))
        return buffer, await buffer.get_batch(1, version=4)

    buffer, batch = asyncio.run(go())
    assert [g[0].group_id for g in batch] == ["at v"]
    assert buffer.dropped == {"behind v": "stale"} and buffer.delivered == {"at v": 4}


def test_get_batch_waits_and_measures_trainer_wait():
    async def go():
        buffer = RolloutBuffer(groups_per_step=2, max_staleness=0)
        consumer = asyncio.create_task(buffer.get_batch(2))
        await buffer.put(group("a", [0]))
        await asyncio.sleep(0.1)
        assert not consumer.done()
        await buffer.put(group("b", [0]))
        return buffer, await consumer

    buffer, batch = asyncio.run(go())
    assert [g[0].group_id for g in batch] == ["a", "b"] and buffer.trainer_wait_s >= 0.09


def test_a_group_settles_once():
    buffer = RolloutBuffer(groups_per_step=1, max_staleness=0)
    buffer.drop("g", "zero_variance")
    with pytest.raises(AssertionError, match="settled twice"):
        buffer.drop("g", "stale")


@pytest.mark.parametrize(
    "field, value",
    [
        ("n_samples_per_prompt", 0),
        ("max_staleness", -1),
        ("stale_policy", "keep"),
        ("top_p", 0.0),
        ("top_k", 0),
        ("oversample_factor", 0.5),
        ("dataset", "x.jsonl"),
    ],
)
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"rollout.{field}"):
        RolloutConfig(**{field: value})
