"""`rollout.environment: {kind: reasoning_gym}` trains on reasoning-gym's procedural prompts, and
every trained reward equals reasoning-gym's own `score_answer` of the same response."""

from __future__ import annotations

import pytest
import reasoning_gym

from tests.signals.env_runs import CHAT, STEPS, run_environment

ARITHMETIC = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=["+"], seed=25, size=4)
"""Seed 25's four items answer -1, 11, 1 and 2: a model that only writes "1" earns 0, 2/len,
1/len and 0 (score_answer's partial credit when the answer is inside the response)."""


@pytest.mark.world
@pytest.mark.timeout(600)
def test_reasoning_gym_rewards_are_its_own_scores(tmp_path):
    options = {**ARITHMETIC, "system_prompt": "", "extract_answer": False}
    environment = {"kind": "reasoning_gym", "name": "basic_arithmetic", "options": options}
    metrics, records = run_environment(tmp_path, environment, emits="1", max_new_tokens=4)

    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert all(m["rollout/reward_errors"] == 0 for m in metrics)
    dataset = reasoning_gym.create_dataset("basic_arithmetic", **ARITHMETIC)
    assert len(records) == STEPS * 4
    for record in records:
        entry = dataset[record["answer"]["index"]]
        assert CHAT.tokenizer.decode(record["prompt_ids"]).endswith(
            f"<|im_start|>user\n{entry['question']}<|im_end|>\n<|im_start|>assistant\n"
        )
        response = CHAT.tokenizer.decode(record["response_ids"], skip_special_tokens=True)
        assert response == "1111"
        assert record["reward"] == dataset.score_answer(response, entry)
    assert {r["reward"] for r in records} == {0.0, 0.25, 0.5}  # all four items were drawn
