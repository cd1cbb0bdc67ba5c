"""`RewardScorer`: a reward that raises or hangs scores 0, is counted and logged once; later calls
still score; threads are reused, except one stuck in its call (plain asyncio and threads, no
processes)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

from moe_rl.rollout.config import RolloutConfig
from moe_rl.rollout.scoring import RewardScorer

RELEASE = threading.Event()  # lets the stuck rewards' threads end with the test


def length_reward(text, answer, sample):
    return len(text)


def flaky_reward(text, answer, sample):
    if text == "boom":
        raise KeyError("no such answer")
    return 1.0


def stuck_reward(text, answer, sample):
    if text == "hang":
        RELEASE.wait(30)
    return 1.0


@pytest.fixture(autouse=True)
def release_stuck_threads():
    RELEASE.clear()
    yield
    RELEASE.set()


def test_a_raising_reward_scores_zero_is_counted_and_logged_once(caplog):
    scorer = RewardScorer(flaky_reward, timeout_s=5, workers=2, prefix="eval/gsm8k")

    async def main():
        return await asyncio.gather(*[scorer.score(t, None, None) for t in ("boom", "ok", "boom")])

    with caplog.at_level(logging.WARNING, logger="moe_rl.rollout.scoring"):
        assert asyncio.run(main()) == [0.0, 1.0, 0.0]
        assert scorer.score_blocking("boom", None, None) == 0.0
    assert scorer.metrics() == {"eval/gsm8k/reward_errors": 3, "eval/gsm8k/reward_timeouts": 0}
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "flaky_reward" in warnings[0].getMessage() and "KeyError" in warnings[0].getMessage()
    assert warnings[0].exc_info is not None  # the traceback


def test_a_reward_that_returns_no_number_is_an_error():
    scorer = RewardScorer(lambda text, answer, sample: "high", timeout_s=5, workers=1)
    assert scorer.score_blocking("x", None, None) == 0.0
    assert scorer.metrics() == {"rollout/reward_errors": 1, "rollout/reward_timeouts": 0}


def test_a_stuck_reward_times_out_and_does_not_starve_later_calls(caplog):
    scorer = RewardScorer(stuck_reward, timeout_s=0.3, workers=1)

    async def main():
        start = time.perf_counter()
        stuck = await scorer.score("hang", None, None)
        waited = time.perf_counter() - start
        # the only slot was the stuck call's: it was given back at the timeout
        later = await asyncio.gather(*[scorer.score("fine", None, None) for _ in range(3)])
        return stuck, waited, later

    with caplog.at_level(logging.WARNING, logger="moe_rl.rollout.scoring"):
        stuck, waited, later = asyncio.run(main())
        assert stuck == 0.0 and 0.3 <= waited < 1.5
        assert later == [1.0, 1.0, 1.0]
        assert scorer.score_blocking("hang", None, None) == 0.0 and scorer.score_blocking("x", None, None) == 1.0
    assert scorer.metrics() == {"rollout/reward_errors": 0, "rollout/reward_timeouts": 2}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "stuck_reward" in warnings[0]
    assert "RELEASE.wait" in warnings[0]  # where the reward's thread is stuck


def test_threads_are_reused_except_one_stuck_in_its_call():
    ran_on = []

    def reward(text, answer, sample):
        ran_on.append(threading.get_ident())
        return stuck_reward(text, answer, sample)

    scorer = RewardScorer(reward, timeout_s=0.3, workers=1)

    async def main():
        return [await scorer.score(text, None, None) for text in ("a", "b", "hang", "c", "d")]

    assert asyncio.run(main()) == [1.0, 1.0, 0.0, 1.0, 1.0]
    first, stuck, fresh = ran_on[0], ran_on[2], ran_on[3]
    assert ran_on[:3] == [first] * 3  # one thread, idle between calls
    assert fresh != stuck and ran_on[4] == fresh  # the stuck one kept its call; a new one took over
    RELEASE.set()  # the stuck call returns: its thread is idle again, and taken by the next call
    while len(scorer._threads._idle) < 2:
        time.sleep(0.01)
    assert scorer.score_blocking("e", None, None) == 1.0 and ran_on[5] in (stuck, fresh)


def test_close_ends_idle_threads_now_and_a_stuck_one_when_its_call_returns():
    ran_on = {}

    def reward(text, answer, sample):
        ran_on[text] = threading.get_ident()
        return stuck_reward(text, answer, sample)

    scorer = RewardScorer(reward, timeout_s=0.3, workers=2)

    async def main():
        return await asyncio.gather(scorer.score("hang", None, None), scorer.score("fine", None, None))

    assert asyncio.run(main()) == [0.0, 1.0]
    threads = {thread.ident: thread for thread in threading.enumerate()}
    stuck, idle = threads[ran_on["hang"]], threads[ran_on["fine"]]
    scorer.close()
    idle.join(timeout=30)
    assert not idle.is_alive() and stuck.is_alive()
    RELEASE.set()
    stuck.join(timeout=30)
    assert not stuck.is_alive()


def test_a_reward_that_raises_timeout_error_counts_as_a_timeout():
    def grader_past_its_limit(text, answer, sample):
        raise TimeoutError("the grader's child ran past 10 s")

    scorer = RewardScorer(grader_past_its_limit, timeout_s=5, workers=1)
    assert asyncio.run(scorer.score("x", None, None)) == 0.0
    assert scorer.metrics() == {"rollout/reward_errors": 0, "rollout/reward_timeouts": 1}


def test_scores_run_concurrently_up_to_workers():
    scorer = RewardScorer(lambda text, answer, sample: time.sleep(0.2) or 1.0, timeout_s=5, workers=4)

    async def main():
        start = time.perf_counter()
        scores = await asyncio.gather(*[scorer.score("x", None, None) for _ in range(4)])
        return scores, time.perf_counter() - start

    scores, took = asyncio.run(main())
    assert scores == [1.0] * 4 and took < 0.6
    assert RewardScorer(length_reward, timeout_s=1, workers=1).score_blocking("abc", None, None) == 3.0


def test_reward_timeout_must_be_positive():
    with pytest.raises(ValueError, match="rollout.reward_timeout_s"):
        RolloutConfig(reward_timeout_s=0)
