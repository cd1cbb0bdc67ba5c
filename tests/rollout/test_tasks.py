"""Tasks and rewards: registry, math answers, digit tasks, datasets with a real HF tokenizer."""

from __future__ import annotations

import itertools
import json
import re

import pytest

from moe_rl.sample import Sample
from moe_rl.tasks import get_reward, make_task, task_names
from moe_rl.tasks.digits import DIGIT0, SEP

SAMPLE = Sample(prompt_ids=[1])


def user_reward(response, answer, sample):  # loaded as "test_tasks:user_reward"
    return float(len(response))


@pytest.mark.world  # the math grader spawns its child process (moe_rl.tasks.math)
@pytest.mark.parametrize(
    "text, answer",
    [
        ("so the result is \\boxed{\\frac{1}{2}}.", "0.5"),
        ("x = 3, then 1,234.", "1234"),
        ("\\boxed{x^{2}} or 7", "x^{2}"),
        ("answer: -4", "-4"),
    ],
)
def test_math_reward_matches_final_answers(text, answer):
    assert get_reward("math")(text, answer, SAMPLE) == 1.0
    assert get_reward("math")(text, "999", SAMPLE) == 0.0


@pytest.mark.world
def test_math_reward_without_an_answer_is_zero():
    assert get_reward("math")("nothing", "1", SAMPLE) == 0.0


def test_reward_registry_resolves_names_tasks_and_module_functions():
    assert {"copy_digits", "reverse_digits", "sum_mod10", "dataset"} <= set(task_names())
    assert get_reward("test_tasks:user_reward")("abc", None, SAMPLE) == 3.0
    assert get_reward("copy_digits")("12", "13", SAMPLE) == 0.5
    for bad in ("nope", "no_such_module:f", "math_mod:"):
        with pytest.raises(ValueError, match="rollout.reward"):
            get_reward(bad)
    with pytest.raises(ValueError, match="rollout.task"):
        make_task("nope")


USER_CODE = """
from moe_rl.tasks import Prompt, Task


class Copy(Task):
    def __init__(self, n: int = 1):
        self.n = n

    def prompts(self, seed):
        while True:
            yield Prompt(prompt_ids=[seed + 1] * self.n, answer="x")

    def decode(self, ids):
        return "".join(map(str, ids))

    def reward(self, response, answer, sample):
        return 0.0


def score(response, answer, sample):
    return 1.0


async def async_score(response, answer, sample):
    return 1.0


def two_args(response, answer):
    return 1.0


async def agent(episode):
    return 1.0


NOT_CALLABLE = 3
"""


def test_user_tasks_rewards_and_agents_import_from_modules_and_are_checked(tmp_path, monkeypatch):
    from moe_rl.tasks.registry import resolve_agent, task_class

    (tmp_path / "user_code_a.py").write_text(USER_CODE)
    (tmp_path / "broken_on_import.py").write_text("raise RuntimeError('no GPU here')\n")
    (tmp_path / "needs_missing.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    task = make_task("user_code_a:Copy", n=2)
    assert next(task.prompts(4)).prompt_ids == [5, 5] and task.decode([1, 2]) == "12"
    assert get_reward("user_code_a:score")("", None, SAMPLE) == 1.0
    assert resolve_agent("user_code_a:agent").__name__ == "agent"
    refusals = [
        (task_class, "user_code_a:score", "rollout.task='user_code_a:score' is the function score, not a subclass"),
        (task_class, "user_code_a:Nope", "user_code_a (" + str(tmp_path / "user_code_a.py") + ") has no 'Nope'"),
        (task_class, "no_such_mod_q:X", "cannot import 'no_such_mod_q' (No module named 'no_such_mod_q'): put"),
        (task_class, "broken_on_import:X", "importing 'broken_on_import' failed (RuntimeError: no GPU here)"),
        (task_class, "needs_missing:X", "importing 'needs_missing' failed (No module named 'no_such_dependency_xyz')"),
        (get_reward, "user_code_a:Copy", "rollout.reward='user_code_a:Copy' is the class Copy; give a function"),
        (
            get_reward,
            "user_code_a:NOT_CALLABLE",
            "is an object of type int; give a function reward(response, answer, sample)",
        ),
        (get_reward, "user_code_a:async_score", "is an async function; rewards run on worker threads"),
        (get_reward, "user_code_a:two_args", "takes (response, answer); give a function reward(response, answer"),
        (resolve_agent, "user_code_a:score", "rollout.agent='user_code_a:score' is not an async function"),
        (resolve_agent, "user_code_a", "rollout.agent='user_code_a': use 'package.module:name'"),
    ]
    for resolve, spec, message in refusals:
        with pytest.raises(ValueError, match=re.escape(message)):
            resolve(spec)


def test_digit_tasks_are_seeded_and_score_positions():
    task = make_task("reverse_digits", length=3)
    first = list(itertools.islice(task.prompts(7), 5))
    assert first == list(itertools.islice(task.prompts(7), 5)) != list(itertools.islice(task.prompts(8), 5))
    prompt = first[0]
    digits = prompt.metadata["digits"]
    assert prompt.prompt_ids == [1] + [DIGIT0 + d for d in digits] + [SEP] and prompt.answer == "".join(
        map(str, digits[::-1])
    )
    right = [DIGIT0 + d + 30 for d in digits[::-1]]  # any id reads as id % 10
    assert task.reward(task.decode(right), prompt.answer, SAMPLE) == 1.0
    wrong_last = right[:2] + [right[2] + 1]
    assert task.reward(task.decode(wrong_last), prompt.answer, SAMPLE) == pytest.approx(2 / 3)
    sums = make_task("sum_mod10", length=4)
    p = next(sums.prompts(0))
    assert p.answer == str(sum(p.metadata["digits"]) % 10)


@pytest.mark.world  # its reward is "math": the grader spawns its child
def test_dataset_with_text_and_ids(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "what", "is", "2+2", "?", "4", "\\boxed{4}"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]").save_pretrained(tmp_path / "model")
    rows = [
        {"prompt": "what is 2+2 ?", "answer": "4", "metadata": {"source": "t"}},
        {"prompt_ids": [1, 2, 3], "answer": 4},
    ]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    task = make_task("dataset", path=path, tokenizer_dir=tmp_path / "model")
    prompts = list(itertools.islice(task.prompts(0), 4))
    assert sorted(map(tuple, (p.prompt_ids for p in prompts[:2]))) == [(1, 2, 3), (1, 2, 3, 4)]
    assert {p.metadata.get("source") for p in prompts} == {"t", None}
    assert task.reward(task.decode([6]), "4", SAMPLE) == 1.0  # decoded "\boxed{4}" through the tokenizer
    path = tmp_path / "no_answer.jsonl"
    path.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match="answer"):
        make_task("dataset", path=path, tokenizer_dir=tmp_path / "model")
    path = tmp_path / "text.jsonl"
    path.write_text('{"prompt": "x", "answer": 1}\n')
    with pytest.raises(ValueError, match="tokenizer"):
        make_task("dataset", path=path)
