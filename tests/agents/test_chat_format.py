"""The chat template path, without an engine: the shipped tiny tokenizer, token-in-token-out
extensions of a record, tool calls and reasoning, chat-format JSONL prompts, and the checks a run makes
before any process starts."""

from __future__ import annotations

import json

import pytest

from moe_rl.agents import ChatFormat
from moe_rl.agents.endpoint import completion_message
from moe_rl.agents.episode import Turn
from moe_rl.agents.tiny_tokenizer import build, lookup_call
from moe_rl.config import RunConfig, from_dict
from moe_rl.tasks import make_task
from tests.agents.conftest import CHAT_DIR
from tests.tiny_models import QWEN3_MOE_SMALL, hf_fields

CHAT = ChatFormat.load(CHAT_DIR)
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]


def test_shipped_tokenizer_is_what_the_builder_writes(tmp_path):
    build(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / name).read_text() == (CHAT_DIR / name).read_text(), name
    assert len(CHAT.tokenizer) == 128 and CHAT.eos_text == "<|im_end|>"


def test_extension_adds_only_the_new_messages_and_the_template_glue():
    user = [{"role": "user", "content": "key C"}]
    prompt = CHAT.prompt_ids(user, TOOLS)
    sampled = CHAT.encode(lookup_call("C")) + [CHAT.eos_id]
    reply = CHAT.parse(sampled).message()
    tool = {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "7"}
    env = CHAT.extension_ids([*user, reply], [*user, reply, tool], TOOLS, turn_ended=True)
    whole = CHAT.render([*user, reply, tool], TOOLS, generation_prompt=True)
    assert CHAT.tokenizer.decode(prompt + sampled + env) == whole  # the same text, the sampled ids kept
    assert CHAT.tokenizer.decode(env) == "\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n"
    cut = CHAT.extension_ids([*user, reply], [*user, reply, tool], TOOLS, turn_ended=False)
    assert cut == [CHAT.eos_id] + env  # a turn cut by its budget gets its end-of-turn token as glue
    rewritten = [{"role": "user", "content": "key D"}, reply, tool]
    assert CHAT.extension_ids([*user, reply], rewritten, TOOLS, turn_ended=True) is None
    assert CHAT.extension_ids([*user, reply], [*user, reply], TOOLS, turn_ended=True) is None  # nothing new


def test_a_turn_parses_into_reasoning_content_and_tool_calls():
    """The tiny tokenizer's family (Qwen3-MoE): qwen25 tool calls, qwen3 reasoning."""
    good = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    text = "<think>check f</think>x " + good + "\n<tool_call>\n{bad}\n</tool_call>\nafter"
    parsed = CHAT.parse(CHAT.encode(text) + [CHAT.eos_id], TOOLS)
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("f", {"a": 1})]
    assert (parsed.reasoning, parsed.content, parsed.tool_errors) == ("check f", "x", 1)
    message = parsed.message()
    assert message["reasoning_content"] == "check f"
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"a": 1}
    plain = CHAT.parse(CHAT.encode("hello <tool_call>{}"))  # no think block, no call: the text as it is
    assert (plain.reasoning, plain.content, plain.tool_calls) == (None, "hello <tool_call>{}", [])
    assert set(plain.message()) == {"role", "content"}
    turn = Turn(parsed.text, parsed.content, parsed.tool_calls, [], "stop", 0, parsed.reasoning)
    assert completion_message(turn, CHAT, "auto") == message
    untooled = completion_message(turn, CHAT, "none")  # as SGLang: reasoning split off, calls left as text
    assert untooled == {"role": "assistant", "content": text.split("</think>")[1], "reasoning_content": "check f"}
    with pytest.raises(ValueError, match="tool_call_format='mistral': not a tool-call format.*qwen25"):
        ChatFormat(CHAT.tokenizer, "mistral")
    with pytest.raises(ValueError, match="reasoning_parser='auto' is resolved from the model's type"):
        ChatFormat(CHAT.tokenizer, "qwen25", "auto")


def test_dataset_chat_prompts_render_with_the_template(tmp_path):
    data = tmp_path / "data.jsonl"
    rows = [
        {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}], "answer": "4"},
        {"prompt": "3+3?", "answer": "6"},
    ]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    chat = make_task("dataset", path=data, tokenizer_dir=CHAT_DIR, apply_chat_template=True)
    assert chat.prompt(0).prompt_ids == CHAT.prompt_ids(rows[0]["prompt"])
    assert CHAT.tokenizer.decode(chat.prompt(1).prompt_ids) == (
        "<|im_start|>user\n3+3?<|im_end|>\n<|im_start|>assistant\n"
    )
    raw = make_task("dataset", path=data, tokenizer_dir=CHAT_DIR)
    assert raw.prompt(0).prompt_ids == chat.prompt(0).prompt_ids and raw.prompt(1).prompt_ids == CHAT.encode("3+3?")
    with pytest.raises(ValueError, match="set model.tokenizer"):
        make_task("dataset", path=data)
    data = tmp_path / "no_role.jsonl"
    data.write_text(json.dumps({"prompt": [{"content": "no role"}], "answer": 1}))
    with pytest.raises(ValueError, match="no_role.jsonl': column 'prompt' is .*'role'"):
        make_task("dataset", path=data, tokenizer_dir=CHAT_DIR)


def run_config(tmp_path, rollout: dict, model: dict | None = None) -> RunConfig:
    fields = hf_fields(QWEN3_MOE_SMALL, vocab_size=128, max_position_embeddings=128)
    return from_dict(
        RunConfig,
        {
            "model": {"hf_config": fields, **(model or {})},
            "trainer": {"global_batch_size": 4, "micro_batch_size": 4},
            "rollout": {"groups_per_step": 2, "n_samples_per_prompt": 2, **rollout},
            "output_dir": str(tmp_path / "run"),
        },
    )


@pytest.mark.parametrize(
    "rollout, model, message",
    [
        ({"task": "lookup", "agent": "moe_rl.tasks.lookup:nope"}, {"tokenizer": str(CHAT_DIR)}, "has no|not an async"),
        ({"task": "lookup", "agent": "no_such_module:f"}, {"tokenizer": str(CHAT_DIR)}, "cannot import"),
        ({"task": "lookup", "agent": "moe_rl.tasks.lookup:lookup_agent"}, {}, "set model.tokenizer"),
        (
            {"task": "copy_digits", "agent": "moe_rl.tasks.lookup:lookup_agent"},
            {"tokenizer": str(CHAT_DIR)},
            "agents need chat messages",
        ),
        (
            {"task": "lookup", "agent": "moe_rl.tasks.lookup:lookup_agent", "episode": {"max_context_tokens": 4096}},
            {"tokenizer": str(CHAT_DIR)},
            "max_context_tokens=4096 exceeds",
        ),
    ],
)
def test_agent_runs_are_checked_before_any_process_starts(tmp_path, rollout, model, message):
    from moe_rl.jobs.preflight import check_run

    with pytest.raises(ValueError, match=message):
        check_run(run_config(tmp_path, rollout, model))


def test_episode_options_name_the_field():
    from moe_rl.agents import EpisodeConfig

    for bad, field in [
        ({"max_turns": 0}, "max_turns"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"endpoint_port": -1}, "endpoint_port"),
    ]:
        with pytest.raises(ValueError, match=f"rollout.episode.{field}"):
            EpisodeConfig(**bad)
    with pytest.raises(ValueError, match="model.tokenizer='/nowhere'"):
        from moe_rl.config import ModelConfig

        ModelConfig(hf_config=hf_fields(QWEN3_MOE_SMALL), tokenizer="/nowhere")
