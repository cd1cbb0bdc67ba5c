"""Multi-turn samples in the trainer (Megatron, EP2 on two gloo ranks, fp32): on the model tokens
the trainer's logprobs equal the engine's, and the episodes' routed experts cover every position
the trainer routes, so replay agrees with the engine's routing on every layer."""

from __future__ import annotations

import asyncio

import pytest

from moe_rl.algorithms import AlgorithmConfig
from moe_rl.rollout.train_batch import build_batch
from parallel.world import spawn
from tests.agents.conftest import agent_config, rounds
from tests.tiny_models import QWEN3_MOE_SMALL, hf_config

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

ROWS = 4


def trainer_view(model_dir: str, batch: dict):
    from moe_rl.config import TrainerConfig
    from moe_rl.trainer.megatron_trainer import MegatronTrainer

    config = TrainerConfig(world_size=2, ep=2, routing_replay=True, micro_batch_size=2, global_batch_size=ROWS)
    trainer = MegatronTrainer(config, hf_config(QWEN3_MOE_SMALL, vocab_size=128, max_position_embeddings=512))
    trainer.load_hf_weights(model_dir)
    return trainer.forward_logprobs(batch, replay=True), trainer.natural_forward(batch)[1]


def test_trainer_logprobs_and_routing_on_multi_turn_samples(chat_model, chat_engine):
    (groups,), _, _ = asyncio.run(rounds(agent_config("three_turns", groups_per_step=2), chat_engine.url))
    batch, info = build_batch(groups, AlgorithmConfig(), version=0)
    assert batch.tokens.shape[0] == ROWS and info.masked_tokens > 0 and info.trained_tokens > 0
    (logprobs, agreement), _ = spawn(trainer_view, 2, str(chat_model), batch.tensors())
    mask = batch.loss_mask[:, 1:].bool()
    diff = (logprobs - batch.rollout_logprobs[:, 1:])[mask].abs().max()
    # fp32 on both sides, the same weights: sums of a few hundred products each reduced in another
    # order, logprobs of magnitude ~5 -> differences of a few ulps of 5 (~1e-6)
    assert diff <= 1e-5, diff
    assert agreement == {0: 1.0, 1: 1.0}
    environment = (batch.loss_mask == 0) & (batch.tokens != 0)
    assert environment[:, 1:].any()  # the agreement covered environment positions too
