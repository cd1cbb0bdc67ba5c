"""Served judges without a process: the config's refusals, the pairing with `rollout.reward`, and
how the parser reads a generative judge's answer."""

from __future__ import annotations

import json

import pytest

from moe_rl.rollout.config import RolloutConfig
from moe_rl.signals.config import JudgeConfig
from moe_rl.signals.judge import Judge
from tests.signals.distill_helpers import TEACHER_MODEL
from tests.signals.test_distill_config import TINY_CHAT


@pytest.fixture
def judge_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TEACHER_MODEL))
    return str(tmp_path)


def test_judge_config_refuses_with_the_field(judge_dir):
    refusals = {
        "rollout.judge.kind='pairwise'": {"kind": "pairwise", "path": judge_dir},
        "rollout.judge: give exactly one": {},
        "rollout.judge.template: put {response}": {"path": judge_dir, "template": "no slot"},
        "rollout.judge.parse='(': not a regular": {"path": judge_dir, "parse": "("},
        "rollout.judge: a judge given by url needs rollout.judge.tokenizer": {"url": "http://h:1"},
        "rollout.judge.concurrency=0": {"path": judge_dir, "concurrency": 0},
        "rollout.judge.timeout_s=0": {"path": judge_dir, "timeout_s": 0},
    }
    for message, fields in refusals.items():
        with pytest.raises(ValueError) as error:
            JudgeConfig(**fields)
        assert str(error.value).startswith(message), error.value
    with pytest.raises(ValueError, match="rollout.judge goes with rollout.reward='judge'"):
        RolloutConfig(reward="judge")
    with pytest.raises(ValueError, match="rollout.judge goes with rollout.reward='judge'"):
        RolloutConfig(judge=JudgeConfig(path=judge_dir))
    assert RolloutConfig(reward="judge", judge=JudgeConfig(path=judge_dir)).judge.served.path == judge_dir


def test_the_parser_reads_the_first_match(judge_dir):
    def judge(parse):
        config = JudgeConfig(path=judge_dir, tokenizer=str(TINY_CHAT), parse=parse)
        return Judge(config, "http://127.0.0.1:1")  # no call is made

    assert judge(r"-?\d+(?:\.\d+)?").parse_score("it is 0.75, not 3") == 0.75
    assert judge(r"Score: (\d+)/10").parse_score("7/10? Score: 8/10") == 8.0
    assert judge(r"\d").parse_score("no digits") is None
    assert judge(r"(yes|no)").parse_score("yes") is None  # a match that is no number
    filled = judge(r"\d").prompt_ids("12", "3", None)
    assert judge(r"\d").tokenizer.decode(filled) == JudgeConfig.template.replace("{prompt}", "12").replace(
        "{response}", "3"
    ).replace("{answer}", "")
