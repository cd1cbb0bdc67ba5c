"""The parser registries, `auto` by model type, the errors that name the field, Kimi's call ids, and
Qwen3's real template read back by its parsers. What each format reads is checked against SGLang's
own detectors in tests/conformance/test_tool_parsers.py."""

from __future__ import annotations

import pytest

from moe_rl.agents import ChatFormat, EpisodeConfig, parsers
from moe_rl.config import RunConfig, from_dict
from tests.agents.conftest import CHAT_DIR
from tests.real_tokenizers import tokenizer_dir
from tests.tiny_models import DEEPSEEK_V3, GLM4_MOE, MIXTRAL, QWEN3_MOE_SMALL, hf_fields

ALIASES = {"qwen": "qwen25", "glm": "glm45"}  # SGLang's other names of one detector


def test_every_name_builds_its_parser():
    for registry, build in (
        (parsers.TOOL_PARSERS, parsers.tool_parser),
        (parsers.REASONING_PARSERS, parsers.reasoning_parser),
    ):
        for name, cls in registry.items():
            parser = build(name)
            assert isinstance(parser, cls) and parser.name == ALIASES.get(name, name)
    assert parsers.reasoning_parser("none") is None
    for tool_format, reasoning in parsers.FAMILY_FORMATS.values():
        assert tool_format in parsers.TOOL_PARSERS and reasoning in parsers.REASONING_PARSERS


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"tool_call_format": "mistral"}, r"tool_call_format='mistral': not a tool-call format.*'qwen3_coder'"),
        ({"reasoning_parser": "o1"}, r"reasoning_parser='o1': not a reasoning parser.*'none'.*'deepseek-r1'"),
    ],
)
def test_unknown_names_are_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError, match="rollout.episode." + message):
        EpisodeConfig(**fields)


def test_auto_picks_the_formats_of_the_model_type():
    assert EpisodeConfig().resolved("qwen3_moe").tool_call_format == "qwen25"
    assert EpisodeConfig().resolved("qwen3_moe").reasoning_parser == "qwen3"
    assert (
        EpisodeConfig().resolved("gpt_oss").tool_call_format,
        EpisodeConfig().resolved("kimi_k2").reasoning_parser,
    ) == (
        "gpt-oss",
        "kimi_k2",
    )
    chosen = EpisodeConfig(tool_call_format="deepseekv31", reasoning_parser="none").resolved("deepseek_v3")
    assert (chosen.tool_call_format, chosen.reasoning_parser) == ("deepseekv31", "none")  # a name is kept
    assert EpisodeConfig(reasoning_parser="none").resolved("glm4_moe").tool_call_format == "glm45"
    with pytest.raises(
        ValueError,
        match=r"no formats known for model type 'mixtral' \(known: .*'qwen3_moe'.*set rollout.episode.tool_call_format",
    ):
        EpisodeConfig().resolved("mixtral")
    named = EpisodeConfig(tool_call_format="hermes", reasoning_parser="none")
    assert named.resolved("mixtral") is named  # nothing left to pick


def run_config(tmp_path, model: dict, agent: str | None) -> RunConfig:
    rollout = {"task": "lookup", "agent": agent} if agent else {"task": "copy_digits"}
    return from_dict(
        RunConfig,
        {
            "model": {"hf_config": model, "tokenizer": str(CHAT_DIR)},
            "trainer": {"global_batch_size": 4, "micro_batch_size": 4},
            "rollout": {"groups_per_step": 2, "n_samples_per_prompt": 2, **rollout},
            "output_dir": str(tmp_path / "run"),
        },
    )


@pytest.mark.parametrize(
    "model, formats",
    [
        (hf_fields(QWEN3_MOE_SMALL, vocab_size=128), ("qwen25", "qwen3")),
        (hf_fields(DEEPSEEK_V3), ("deepseekv3", "deepseek-v3")),
        (hf_fields(GLM4_MOE), ("glm45", "glm45")),
    ],
)
def test_a_run_config_resolves_auto_when_agents_run(tmp_path, model, formats):
    episode = run_config(tmp_path, model, "moe_rl.tasks.lookup:lookup_agent").rollout.episode
    assert (episode.tool_call_format, episode.reasoning_parser) == formats


def test_a_model_type_without_formats_fails_only_with_agents(tmp_path):
    assert run_config(tmp_path, hf_fields(MIXTRAL), None).rollout.episode.tool_call_format == "auto"
    with pytest.raises(ValueError, match="rollout.episode.tool_call_format / reasoning_parser 'auto'.*'mixtral'"):
        run_config(tmp_path, hf_fields(MIXTRAL), "moe_rl.tasks.lookup:lookup_agent")


def test_kimi_calls_keep_the_id_the_model_wrote():
    text = (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.lookup:4<|tool_call_argument_begin|>"
        '{"key": "C"}<|tool_call_end|><|tool_calls_section_end|>'
    )
    _, (call,), errors = parsers.tool_parser("kimi_k2").parse(text)
    assert (call.name, call.arguments, call.id, errors) == ("lookup", {"key": "C"}, "functions.lookup:4", 0)
    assert call.openai()["id"] == "functions.lookup:4"  # Kimi's template renders it back


def test_qwen3s_real_template_is_read_back_by_its_auto_parsers():
    """An assistant turn with reasoning, content and two calls, as Qwen3's own template writes it,
    parses back into the same message (reasoning keeps the template's newlines, as SGLang's)."""
    chat = ChatFormat.load(tokenizer_dir("qwen3"), *parsers.FAMILY_FORMATS["qwen3_moe"])
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    arguments = [{"city": "Paris", "days": 3}, {"city": "Rome"}]
    calls = [{"type": "function", "function": {"name": "get_weather", "arguments": a}} for a in arguments]
    user = [{"role": "user", "content": "weather?"}]
    reply = {"role": "assistant", "content": "Checking.", "reasoning_content": "The user asks.", "tool_calls": calls}
    prompt = chat.render(user, tools, True)
    turn = chat.render([*user, reply], tools, False)[len(prompt) :]
    parsed = chat.parse(chat.encode(turn[: turn.index(chat.eos_text)]) + [chat.eos_id], tools)
    assert (parsed.reasoning, parsed.content, parsed.tool_errors) == ("\nThe user asks.\n", "Checking.", 0)
    assert [(call.name, call.arguments) for call in parsed.tool_calls] == [("get_weather", a) for a in arguments]
