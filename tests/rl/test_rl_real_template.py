"""An RL run on Qwen3's real tokenizer and chat template (a tiny Qwen3-MoE over its 151,669 ids):
agent episodes from a JSONL of chat prompts with tools, an OpenAI-SDK agent that answers each tool
call, R3 over every position. Every episode stays one sequence (no fork), the tool results are in
the trained batches with loss mask 0, and the dumped records decode to Qwen3's own rendering."""

from __future__ import annotations

import json

import pytest

from moe_rl.agents import ChatFormat
from moe_rl.rollout.dump import SampleDump
from tests.real_tokenizers import tokenizer_dir
from tests.rl.test_rl_modes import STEPS, check_ledger, run, tiny_config
from tests.tiny_models import QWEN3_MOE_SMALL, hf_fields

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "The value stored under a key.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
    },
}


def test_agent_episodes_from_chat_jsonl_on_qwen3s_template(tmp_path):
    qwen3 = tokenizer_dir("qwen3")
    chat = ChatFormat.load(qwen3)
    rows = [
        {
            "prompt": [
                {"role": "system", "content": "Answer with the value the lookup tool gives."},
                {"role": "user", "content": f"What is stored under key {key}?"},
            ],
            "tools": [LOOKUP],
            "answer": str(value),
            "metadata": {"table": {key: str(value)}},
        }
        for key, value in zip("ABCDEFGH", range(8))
    ]
    (tmp_path / "agent.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    rollout = {
        "task": "dataset",
        "task_options": {},
        "dataset": str(tmp_path / "agent.jsonl"),
        "metadata_keys": ["metadata"],
        "agent": "tests.agents.agents_for_tests:openai_lookup_from_metadata",
        "max_new_tokens": 6,
        "episode": {"max_context_tokens": 512, "max_turns": 3},
        "dump": True,
    }
    fields = hf_fields(
        QWEN3_MOE_SMALL, vocab_size=len(chat.tokenizer), eos_token_id=chat.eos_id, max_position_embeddings=512
    )
    model = {"tokenizer": str(qwen3), "hf_config": fields}
    summary, metrics = run(tiny_config(tmp_path, "sync", rollout, model, {"micro_batch_size": 2}))
    check_ledger(summary)
    assert all(r["agents/forked_sequences"] == 0 for r in metrics)
    assert all(r["agents/turns_per_episode"] == 2 for r in metrics)
    assert all(r["rollout/masked_tokens"] > 0 for r in metrics)  # tool results, with loss mask 0
    dumps = SampleDump(tmp_path / "sync" / "rollouts")
    records = [record for step in range(1, STEPS + 1) for record in dumps.read(step)]
    assert len(records) == STEPS * 4 * 2
    for record in records:
        assert record["episode"]["sequences"] == 1, record["episode"]
        text = record["prompt_text"] + record["response_text"]
        assert text.startswith("<|im_start|>system\nAnswer with the value the lookup tool gives.\n\n# Tools")
        assert "<|im_end|>\n<|im_start|>user\n<tool_response>\n" in text  # the tool result, as Qwen3 renders it
