"""`rollout.environment: {kind: openenv}` trains on an OpenEnv server that the adapter starts
(tests/signals/openenv_digit.py under uvicorn): two-turn episodes through the environment's
client, and every trained reward equals the environment's own step rewards for the same replies."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.signals.env_runs import CHAT, STEPS, run_environment

HERE = Path(__file__).resolve().parent


@pytest.mark.world
@pytest.mark.timeout(600)
def test_openenv_rewards_are_the_environments_own(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))  # uvicorn imports the app module by name, in every process
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
    from openenv_digit import DigitAction, DigitEnv

    environment = {"kind": "openenv", "name": "openenv_digit", "options": {}}
    metrics, records = run_environment(tmp_path, environment, emits="1", max_new_tokens=1)

    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert all(m["agents/episodes"] == 4 and m["agents/dropped_agent_error"] == 0 for m in metrics)
    assert len(records) == STEPS * 4
    for record in records:
        seed = record["answer"]
        assert record["prompt_ids"] == CHAT.prompt_ids([{"role": "user", "content": f"digit {seed % 10}"}])
        # turn 1, the observation after the first step as a user turn, turn 2
        again = "<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
        assert CHAT.tokenizer.decode(record["response_ids"]) == f"1{again}1"
        env = DigitEnv()  # the environment's own scoring of the same two replies
        env.reset(seed=seed)
        expected = sum(env.step(DigitAction(message=reply)).reward for reply in ("1", "1"))
        assert record["reward"] == expected == (1.25 if seed % 10 == 1 else 0.0)
    assert {r["reward"] for r in records} == {0.0, 1.25}
