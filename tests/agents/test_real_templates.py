"""Episodes on the real chat templates of the MoE families (tokenizers from `tests.real_tokenizers`):
a three-call OpenAI-SDK episode (a reply answered by a tool result, then a user follow-up) stays
one token sequence; the environment ids are what the family's template renders for those
messages; the record is the engine's ids (sampled ids kept, routing rows for every position);
and, where turns end with the stop token, the record reads as the template's rendering of the
whole conversation, except the empty think blocks Qwen3 puts in generation prompts and drops
from earlier turns. A history rewrite still forks."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from moe_rl.agents import ChatFormat
from moe_rl.agents.config import EpisodeConfig
from moe_rl.engine.process import launch_embedded
from tests.agents import agents_for_tests
from tests.agents.conftest import agent_config
from tests.agents.test_episode_record import check_record
from tests.real_tokenizers import tokenizer_dir
from tests.rollout.rollout_helpers import make_pool
from tests.tiny_models import QWEN3_MOE_SMALL, hf_config, save_random_model

pytestmark = pytest.mark.world  # starts processes: an engine (tests/conftest.py)

NO_THINKING = {"enable_thinking": False}
FAMILIES = {  # name: (tokenizer package, chat template arguments)
    "qwen3": ("qwen3", {}),
    "qwen3_no_thinking": ("qwen3", NO_THINKING),
    "deepseek_v3": ("deepseek_v3", {}),
}
EMPTY_THINK = "<think>\n\n</think>\n\n"
_QWEN3 = [
    "\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
    "\n<|im_start|>user\nand now?<|im_end|>\n<|im_start|>assistant\n",
]
ENVIRONMENT = {  # what each template renders after a finished assistant turn for the tool result, then the follow-up
    "qwen3": _QWEN3,
    "qwen3_no_thinking": [text + EMPTY_THINK for text in _QWEN3],
    "deepseek_v3": [
        "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>7<｜tool▁output▁end｜><｜tool▁outputs▁end｜>",
        "<｜User｜>and now?<｜Assistant｜>",
    ],
}


def save_model(path, chat: ChatFormat, stops: bool):
    """The small Qwen3-MoE over the tokenizer's whole vocabulary; `stops`: it emits the end-of-turn
    token at every step (each turn is that one token), else random."""
    config = hf_config(
        QWEN3_MOE_SMALL, vocab_size=len(chat.tokenizer), eos_token_id=chat.eos_id, max_position_embeddings=1024
    )
    save_random_model(config, path)
    if stops:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            model.model.embed_tokens.weight[:, 0] = 1000.0
            model.lm_head.weight[:, 0] = 0.0
            model.lm_head.weight[chat.eos_id, 0] = 100.0
        model.save_pretrained(path)
    return path


async def run(config, chat_dir, url):
    """One batch of a fresh manager on a recording pool: (samples, manager, pool)."""
    from moe_rl.rollout import RolloutManager

    pool = make_pool(url, recording=True)
    manager = RolloutManager(config, pool, tokenizer_dir=chat_dir)
    task = asyncio.create_task(manager.run())
    try:
        batch = asyncio.ensure_future(manager.buffer.get_batch(config.groups_per_step))
        await asyncio.wait({batch, task}, return_when=asyncio.FIRST_COMPLETED)
        if not batch.done():
            batch.cancel()
            task.result()
        return [s for group in batch.result() for s in group], manager, pool
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        manager.close()
        await pool.close()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    package, kwargs = FAMILIES[request.param]
    directory = tokenizer_dir(package)
    chat = ChatFormat.load(directory, template_kwargs=kwargs)
    root = tmp_path_factory.mktemp(request.param)
    with (
        launch_embedded(save_model(root / "random", chat, stops=False), threads=1) as random_engine,
        launch_embedded(save_model(root / "stops", chat, stops=True), threads=1) as stopping_engine,
    ):
        yield dataclasses.make_dataclass("Family", ["name", "dir", "chat", "random", "stops"])(
            request.param, directory, chat, random_engine.url, stopping_engine.url
        )


def config_for(family, agent: str):
    episode = EpisodeConfig(chat_template_kwargs=FAMILIES[family.name][1], max_context_tokens=1024)
    return agent_config(agent, episode=episode, max_new_tokens=4)


def environment_texts(sample, chat: ChatFormat) -> list[str]:
    """The decoded runs of environment tokens (loss mask 0) in the response."""
    runs, current = [], []
    for token, mask in zip(sample.response_ids, sample.loss_mask):
        if mask:
            if current:
                runs.append(chat.tokenizer.decode(current))
            current = []
        else:
            current.append(token)
    return runs


def test_three_calls_stay_one_sequence_with_the_templates_text(family):
    samples, manager, pool = asyncio.run(run(config_for(family, "openai_three_calls"), family.dir, family.stops))
    chat = family.chat
    assert manager.metrics()["agents/forked_sequences"] == 0
    for sample in samples:
        assert sample.metadata["sequences"] == 1 and sample.metadata["turns"] == 3
        counts = check_record(sample, pool.calls)  # sampled ids as the engine gave them; rows for every position
        assert [sampled for _, sampled in counts] == [1, 1, 1]  # each turn: the stop token
        assert [t for t, m in zip(sample.response_ids, sample.loss_mask) if m] == [chat.eos_id] * 3
        assert environment_texts(sample, chat) == ENVIRONMENT[family.name]
        # the whole conversation as the template renders it, the last turn left out
        record = chat.tokenizer.decode(sample.prompt_ids + sample.response_ids[:-1])
        messages = agents_for_tests.CONVERSATIONS[sample.group_id, sample.metadata["episode"]]
        whole = chat.render(messages[:-1], [agents_for_tests.TOOL], True)
        assert record.replace(EMPTY_THINK, "") == whole.replace(EMPTY_THINK, "")
        if family.name == "qwen3_no_thinking":
            assert record.count(EMPTY_THINK) == 3 and whole.count(EMPTY_THINK) == 1  # every turn saw one


def test_turns_cut_by_their_budget_are_closed_and_continued(family):
    samples, manager, pool = asyncio.run(run(config_for(family, "openai_three_calls"), family.dir, family.random))
    chat = family.chat
    assert manager.metrics()["agents/forked_sequences"] == 0
    for sample in samples:
        assert sample.metadata["sequences"] == 1
        counts = check_record(sample, pool.calls)
        for env_text, (_, sampled) in zip(environment_texts(sample, chat), counts):
            if sampled == 4:  # cut by max_tokens (else it ended on the stop token)
                assert env_text.startswith(chat.eos_text)


def test_a_history_rewrite_still_forks(family):
    samples, manager, _ = asyncio.run(run(config_for(family, "openai_rewrites_history"), family.dir, family.stops))
    assert manager.metrics()["agents/forked_sequences"] == len(samples) // 2
    assert {s.metadata["sequences"] for s in samples} == {2}
