"""Agent datasets and user code through real RL runs (Ray, Megatron EP2, a real embedded engine):

1. a JSONL of chat prompts with tools and metadata drives agent episodes (the OpenAI-SDK lookup
   agent): each trained sequence starts from its row's messages and tools as the chat template
   renders them, the tool reads the row's metadata, and its result is in the record;
2. `rollout.task: user_rl:ToolTask`, `rollout.agent: user_rl:chat` and `rollout.reward:
   user_rl:score` from a module in the directory `moe-rl train` runs in (not on PYTHONPATH): the
   driver's checks import it, and so does the Ray rollout actor.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from moe_rl.agents import ChatFormat
from moe_rl.agents.tiny_tokenizer import lookup_call
from moe_rl.rollout.dump import SampleDump
from moe_rl.tasks.lookup import KEY_CREDIT, LOOKUP_TOOL
from tests.agents.conftest import CHAT_DIR, save_chat_model
from tests.tiny_models import QWEN3_MOE_SMALL, hf_fields

pytestmark = pytest.mark.world  # starts Ray, trainer ranks and an engine (tests/conftest.py)

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
REPO = Path(__file__).resolve().parents[2]
CHAT = ChatFormat.load(CHAT_DIR)
STEPS = 3


def run_config(tmp_path: Path, rollout: dict, model: dict) -> dict:
    return {
        "model": {"tokenizer": str(CHAT_DIR), **model},
        "trainer": {"world_size": 2, "ep": 2, "micro_batch_size": 2, "global_batch_size": 4},
        "rollout": {"groups_per_step": 2, "n_samples_per_prompt": 2, "max_staleness": 0, "dump": True, **rollout},
        "sync": {"pause_mode": "abort", "bucket_bytes": 1 << 20},
        "rl": {"mode": "sync", "report": False, "save_hf": False},
        "steps": STEPS,
        "output_dir": str(tmp_path / "run"),
    }


def lookup_rows() -> list[dict]:
    """Rows as `moe_rl.tasks.lookup` makes its prompts: the key in the user turn, the table the
    tool reads in the row's metadata, the value as the answer."""
    rows = []
    for i, key in enumerate("ABCDEF"):
        table = {k: str((i + j) % 10) for j, k in enumerate("ABCDEF")}
        rows.append(
            {
                "prompt": [{"role": "system", "content": f"row {i}"}, {"role": "user", "content": f"key {key}"}],
                "tools": [LOOKUP_TOOL],
                "answer": table[key],
                "metadata": {"key": key, "table": table, "latency_s": 0.0},
            }
        )
    return rows


@pytest.mark.timeout(900)
def test_a_jsonl_of_chat_prompts_with_tools_drives_agent_episodes(tmp_path):
    from moe_rl.config import RunConfig, from_dict
    from moe_rl.jobs import rl

    rows = lookup_rows()
    (tmp_path / "tools.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    call_c = CHAT.encode(lookup_call("C"))[0]  # the model emits this one token every step
    model = save_chat_model(tmp_path / "model", emits=call_c)
    rollout = {
        "task": "dataset",
        "dataset": str(tmp_path / "tools.jsonl"),
        "agent": "moe_rl.tasks.lookup:lookup_openai_agent",
        "max_new_tokens": 2,
        "episode": {"max_turns": 2, "max_context_tokens": 256},
    }
    summary = rl.run(from_dict(RunConfig, run_config(tmp_path, rollout, {"path": str(model)})))

    metrics = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert all(m["agents/forked_sequences"] == 0 and m["rollout/masked_tokens"] > 0 for m in metrics)
    assert all(m["agents/metric/called"] == 1.0 and m["agents/metric/right_answer"] == 0.0 for m in metrics)
    assert set(summary["trained_group_ids"]) == set(summary["ledger"]["delivered"])
    by_prompt = {tuple(CHAT.prompt_ids(row["prompt"], row["tools"])): row for row in rows}
    records = [r for step in range(1, STEPS + 1) for r in SampleDump(tmp_path / "run" / "rollouts").read(step)]
    assert len(records) == STEPS * 4
    for record in records:
        row = by_prompt[tuple(record["prompt_ids"])]  # the row's messages and tools, rendered by the template
        assert record["prompt_text"].startswith("<|im_start|>system\ntools: lookup<|im_end|>\n")
        # the agent called lookup(C); the tool read C's value in the row's metadata
        assert record["episode"]["calls"][0] == {"turn": 1, "name": "lookup", "arguments": {"key": "C"}}
        assert f"<|im_start|>tool\n{row['metadata']['table']['C']}<|im_end|>" in record["response_text"]
        assert record["answer"] == row["answer"]
        # it calls again where it should answer: only the key credit
        right_key = row["metadata"]["key"] == "C"
        assert record["reward"] == pytest.approx(KEY_CREDIT * right_key)
        assert record["episode"]["metrics"] == {"called": 1.0, "right_key": float(right_key), "right_answer": 0.0}


USER_MODULE = '''
"""A user's task, agent and reward (what `rollout.task`, `rollout.agent`, `rollout.reward` name)."""
import itertools

from moe_rl.tasks import Prompt, Task

TOOL = {"type": "function", "function": {"name": "note", "parameters": {"type": "object"}}}


class ToolTask(Task):
    def __init__(self, topic: str = "tea"):
        self.topic = topic

    def prompts(self, seed):
        for i in itertools.count(seed):
            yield Prompt(messages=[{"role": "user", "content": f"{self.topic} {i % 5}"}], tools=[TOOL], answer="o")

    def decode(self, ids):
        raise NotImplementedError("an agent task")

    def reward(self, response, answer, sample):
        return -1.0  # rollout.reward replaces it


async def chat(episode):
    """Turns until a limit ends the episode: the run scores it with rollout.reward."""
    while True:
        await episode.generate(max_tokens=3)
        episode.add([{"role": "user", "content": "go on"}])


def score(response, answer, sample):
    return len(response) + len(sample.response_ids) / 1000
'''

LAUNCHER = """import sys
from moe_rl.cli import main
sys.exit(main())
"""


@pytest.mark.timeout(900)
def test_user_task_agent_and_reward_from_the_working_directory(tmp_path):
    """`moe-rl train` in a directory holding user_rl.py, launched like the console script (its
    sys.path has the script's directory, not the working directory)."""
    project, bin_dir = tmp_path / "project", tmp_path / "bin"
    project.mkdir(), bin_dir.mkdir()
    (project / "user_rl.py").write_text(textwrap.dedent(USER_MODULE))
    (bin_dir / "moe_rl_launcher.py").write_text(LAUNCHER)
    rollout = {
        "task": "user_rl:ToolTask",
        "task_options": {"topic": "tool"},
        "agent": "user_rl:chat",
        "reward": "user_rl:score",
        "max_new_tokens": 3,
        "episode": {"max_turns": 2, "max_context_tokens": 256},
    }
    config = run_config(tmp_path, rollout, {"hf_config": hf_fields(QWEN3_MOE_SMALL, vocab_size=128, eos_token_id=2)})
    (project / "config.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # moe_rl, not user_rl
    done = subprocess.run(
        [sys.executable, str(bin_dir / "moe_rl_launcher.py"), "train", "config.yaml"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=800,
    )
    assert done.returncode == 0, done.stderr[-4000:]

    records = [r for step in range(1, STEPS + 1) for r in SampleDump(tmp_path / "run" / "rollouts").read(step)]
    assert len(records) == STEPS * 4
    for record in records:
        assert record["prompt_text"].startswith("<|im_start|>system\ntools: note<|im_end|>\n<|im_start|>user\ntool ")
        assert record["status"] == "truncated" and record["episode"]["turns"] == 2
        last_turn = record["response_text"].rsplit("<|im_start|>assistant\n", 1)[1].removesuffix("<|im_end|>")
        assert record["reward"] == pytest.approx(len(last_turn) + record["response_tokens"] / 1000)  # user_rl.score
