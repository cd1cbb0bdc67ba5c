"""Fixtures for agent tests: the tiny chat tokenizer, tiny models of its vocabulary (random, or
biased to emit one token), real embedded engines, and a helper that runs rollout rounds."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from moe_rl.engine.process import EmbeddedConfig, launch_embedded
from moe_rl.rollout import RolloutConfig, RolloutManager
from tests.rollout.rollout_helpers import make_pool
from tests.tiny_models import QWEN3_MOE_SMALL, hf_config, save_random_model

CHAT_DIR = Path(__file__).resolve().parents[2] / "configs" / "tokenizers" / "tiny_chat"
AGENTS = "tests.agents.agents_for_tests"


def save_chat_model(path: Path, seed: int = 0, emits: int | None = None) -> Path:
    """The small Qwen3-MoE with the tiny chat tokenizer's 128 ids (eos <|im_end|> = 2). `emits`:
    make token `emits` win every step (embedding dim 0 = 1000 on every token, so the final norm's
    dim 0 is positive; the lm_head row of `emits` reads only that dim)."""
    config = hf_config(QWEN3_MOE_SMALL, vocab_size=128, eos_token_id=2, max_position_embeddings=512)
    save_random_model(config, path, seed)
    if emits is not None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            model.model.embed_tokens.weight[:, 0] = 1000.0
            model.lm_head.weight[:, 0] = 0.0
            model.lm_head.weight[emits, 0] = 100.0
        model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    return save_chat_model(tmp_path_factory.mktemp("chat_model"))


@pytest.fixture(scope="module")
def chat_engine(chat_model):
    with launch_embedded(EmbeddedConfig(model_path=chat_model, weight_version="0", threads=1)) as process:
        yield process


def agent_config(agent: str, **changes) -> RolloutConfig:
    """A rollout of `agent` on the lookup task; its chat formats resolved as a run config resolves
    them for the tiny Qwen3-MoE."""
    fields = dict(
        task="lookup",
        agent=f"{AGENTS}:{agent}" if ":" not in agent else agent,
        groups_per_step=1,
        n_samples_per_prompt=2,
        max_new_tokens=8,
        max_staleness=0,
    )
    config = RolloutConfig(**{**fields, **changes})
    config.episode = config.episode.resolved("qwen3_moe")
    return config


async def rounds(config: RolloutConfig, url: str, n_batches: int = 1, manager_hook=None):
    """(batches, manager, pool): `n_batches` batches of a fresh manager on a recording pool."""
    pool = make_pool(url, recording=True)
    manager = RolloutManager(config, pool, tokenizer_dir=CHAT_DIR)
    task = asyncio.create_task(manager.run())
    batches = []
    try:
        for version in range(n_batches):
            batch = asyncio.ensure_future(manager.buffer.get_batch(config.groups_per_step))
            await asyncio.wait({batch, task}, return_when=asyncio.FIRST_COMPLETED)
            if not batch.done():  # generation failed: its error
                batch.cancel()
                task.result()
            batches.append(batch.result())
            await manager.buffer.set_version(version + 1)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        manager.close()
        await pool.close()
    return batches, manager, pool
