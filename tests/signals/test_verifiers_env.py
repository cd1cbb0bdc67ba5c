"""`rollout.environment: {kind: verifiers}` trains on verifiers tasksets (tests/signals/vf_digit.py;
vf_lookup.py, whose `lookup` tool is an MCP server), loaded by verifiers' own loader and played
by verifiers' chat harness through the OpenAI endpoint: every trained reward equals the taskset's
own scoring (`Task.score`) of the same conversation, and a tool's answers reach the record from
its server. A taskset whose reward raises scores 0, counted `rollout/reward_errors`; one that does
not load is refused before start."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from moe_rl.rollout.dump import SampleDump
from tests.signals.env_runs import CHAT, STEPS, run_environment

HERE = Path(__file__).resolve().parent


@pytest.fixture
def on_path(monkeypatch):
    """verifiers imports environments by top-level module name: this directory on the path of the
    driver and of Ray's workers."""
    import os

    monkeypatch.syspath_prepend(str(HERE))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))


@pytest.mark.world
@pytest.mark.timeout(600)
def test_verifiers_rewards_are_the_tasksets_own_scores(tmp_path, on_path):
    import verifiers.v1 as vf

    from moe_rl.signals.verifiers_env import conversation_trace, task_messages

    environment = {"kind": "verifiers", "name": "vf_digit", "options": {"num_tasks": 4}}
    heldout = {"kind": "verifiers", "name": "vf_digit", "options": {"num_tasks": 2, "first": 1}}  # digits 1, 2
    evaluate = {"name": "heldout", "environment": heldout, "num_prompts": 2, "n_samples_per_prompt": 2}
    metrics, records = run_environment(tmp_path, environment, emits="1", evaluate=evaluate, max_new_tokens=1)

    train = [m for m in metrics if "rollout/reward_mean" in m]
    assert [m["step"] for m in train] == list(range(1, STEPS + 1))
    assert all(m["rollout/reward_errors"] == 0 and m["agents/episodes"] == 4 for m in train)
    tasks = {t.data.idx: t for t in vf.load_taskset(vf.resolve_env_config({"taskset": {"id": "vf_digit"}}).taskset)}
    assert len(records) == STEPS * 4
    for record in records:
        task = tasks[record["answer"]]
        assert record["prompt_ids"] == CHAT.prompt_ids(task_messages(task))
        reply = CHAT.parse(record["response_ids"]).content
        assert reply == "1"
        trace = conversation_trace(task, [*task_messages(task), {"role": "assistant", "content": reply}])
        asyncio.run(task.score(trace))  # verifiers' own scoring of the same reply
        assert record["reward"] == trace.reward == (1.5 if task.data.digit == "1" else 0.0)
    assert {r["reward"] for r in records} == {0.0, 1.5}
    # the held-out split, evaluated at the end: digit 1 scores 1.5 (pass@1 counts rewards >= 1), digit 2 scores 0
    final = [m for m in metrics if "eval/heldout/reward_mean" in m]
    assert len(final) == 1 and final[0]["eval/heldout/reward_mean"] == 0.75 and final[0]["eval/heldout/pass@1"] == 0.5
    evaluated = SampleDump(tmp_path / "run" / "eval" / "heldout").read(STEPS)
    asked = sorted((CHAT.tokenizer.decode(r["prompt_ids"]).split("user\n")[1][:7], r["reward"]) for r in evaluated)
    assert asked == [("digit 1", 1.5)] * 2 + [("digit 2", 0.0)] * 2


@pytest.mark.world
@pytest.mark.timeout(600)
def test_verifiers_tool_server_turns_are_episodes(tmp_path, on_path):
    """The model calls `lookup` (key B) every turn: verifiers' chat harness sends each call to the
    taskset's MCP server and the answer back, until `rollout.episode.max_turns` ends the episode.
    The record holds that conversation token for token, and its reward is verifiers' scoring of it."""
    import verifiers.v1 as vf
    from vf_lookup_tools import TABLE

    from moe_rl.agents.tiny_tokenizer import lookup_call
    from moe_rl.signals.verifiers_env import conversation_trace, task_messages

    turns = 3
    environment = {"kind": "verifiers", "name": "vf_lookup", "options": {"num_tasks": 3}}
    metrics, records = run_environment(
        tmp_path, environment, emits=lookup_call("B"), max_new_tokens=1, episode={"max_turns": turns}
    )
    train = [m for m in metrics if "rollout/reward_mean" in m]
    assert all(m["rollout/reward_errors"] == 0 and m["agents/episodes"] == 4 for m in train)
    tasks = {t.data.idx: t for t in vf.load_taskset(vf.resolve_env_config({"taskset": {"id": "vf_lookup"}}).taskset)}
    assert len(records) == STEPS * 4
    call = {"id": "-", "type": "function", "function": {"name": "lookup", "arguments": '{"key": "B"}'}}
    tools = [{"type": "function", "function": {"name": "lookup"}}]  # the tiny template shows tool names
    (call_b,) = CHAT.encode(lookup_call("B"))
    answered = f"<|im_start|>tool\n{TABLE['B']}<|im_end|>"
    for record in records:
        task = tasks[record["answer"]]
        assert record["episode"]["turns"] == turns and record["episode"]["tool_calls"] == turns
        # the record: the task's messages, then `turns` calls of lookup(B), each but the last answered
        # by the server's TABLE["B"] (the last answer went into the request the limit refused)
        conversation = task_messages(task)
        for turn in range(turns):
            conversation.append({"role": "assistant", "content": "", "tool_calls": [call]})
            if turn < turns - 1:
                conversation.append({"role": "tool", "tool_call_id": "-", "content": TABLE["B"]})
        assert record["prompt_ids"] + record["response_ids"] == CHAT.prompt_ids(conversation[:-1], tools) + [call_b]
        assert CHAT.tokenizer.decode(record["response_ids"]).count(answered) == turns - 1
        trace = conversation_trace(task, conversation)
        asyncio.run(task.score(trace))  # verifiers' own scoring of the same conversation
        assert trace.rewards["looked_up"].score == 1.0 and trace.rewards["value"].score == 0.0
        assert record["reward"] == trace.reward == 0.5


@pytest.mark.world
@pytest.mark.timeout(600)
def test_a_verifiers_game_answers_each_move(tmp_path, on_path):
    """vf_guess's own `Env` answers each wrong guess with "no" (up to three); the model guesses 7
    every turn. The record holds the game's conversation token for token, and the reward is what
    the env recorded: 1 for the secret 7 (one turn), 0 for 8 and 9 (three turns)."""
    import verifiers.v1 as vf
    from vf_guess import GUESSES

    environment = {"kind": "verifiers", "name": "vf_guess", "options": {}}
    metrics, records = run_environment(tmp_path, environment, emits="7", max_new_tokens=1)
    train = [m for m in metrics if "rollout/reward_mean" in m]
    assert all(m["rollout/reward_errors"] == 0 and m["agents/episodes"] == 4 for m in train)
    tasks = {t.data.idx: t for t in vf.load_taskset(vf.resolve_env_config({"taskset": {"id": "vf_guess"}}).taskset)}
    (seven,) = CHAT.encode("7")
    for record in records:
        found = tasks[record["answer"]].data.secret == "7"
        turns = 1 if found else GUESSES
        assert record["reward"] == float(found) and record["episode"]["turns"] == turns
        conversation = [{"role": "user", "content": "guess a digit"}]
        for turn in range(turns):
            conversation.append({"role": "assistant", "content": "7"})
            if turn < turns - 1:
                conversation.append({"role": "user", "content": "no"})
        assert record["prompt_ids"] + record["response_ids"] == CHAT.prompt_ids(conversation[:-1]) + [seven]
    assert {r["reward"] for r in records} == {0.0, 1.0}  # 4 groups drawn from the 3 tasks' cycle
