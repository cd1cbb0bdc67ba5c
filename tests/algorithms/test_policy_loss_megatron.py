"""The policy loss inside the real Megatron trainer (2 gloo ranks, DP=2): the normaliser each
estimator returns adds up to the documented global value and the report sums arrive intact."""

import math

import pytest
import torch

from parallel.world import spawn
from tests import tiny_models

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

ROWS, SEQ, PROMPT, VOCAB = 4, 9, 3, 256


def _rank(estimators):
    from moe_rl.algorithms import AlgorithmConfig, make_policy_loss, policy_metrics
    from moe_rl.config import TrainerConfig
    from moe_rl.trainer.megatron_trainer import MegatronTrainer

    hf_config = tiny_models.hf_config(tiny_models.QWEN3_MOE_SMALL, vocab_size=VOCAB)
    trainer = MegatronTrainer(TrainerConfig(world_size=2, global_batch_size=ROWS, micro_batch_size=1), hf_config)
    generator = torch.Generator().manual_seed(0)
    mask = torch.zeros(ROWS, SEQ, dtype=torch.long)
    for row, length in enumerate([6, 4, 5, 2]):  # response tokens per sequence
        mask[row, PROMPT : PROMPT + length] = 1
    uniform = torch.full((ROWS, SEQ), -math.log(VOCAB))  # a fresh tiny model is near uniform
    batch = {
        "tokens": torch.randint(0, VOCAB, (ROWS, SEQ), generator=generator),
        "loss_mask": mask,
        "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None].expand(ROWS, SEQ).contiguous(),
        "old_logprobs": uniform,
        "rollout_logprobs": uniform - 0.05,
    }
    results = {}
    for estimator in estimators:
        norm = 8 if estimator == "dr_grpo" else None
        config = AlgorithmConfig(advantage_estimator=estimator, dr_grpo_norm_len=norm)
        result = trainer.train_step(batch, make_policy_loss(config))
        results[estimator] = (
            result.loss,
            result.num_tokens,
            result.grad_norm,
            policy_metrics(result.sums, result.num_tokens),
        )
    return results


def test_normalisers_and_reports_through_megatron():
    results = spawn(_rank, 2, ["grpo", "dr_grpo", "gspo"])
    assert results[0] == results[1]  # every rank gets the same step result
    tokens = 6 + 4 + 5 + 2  # response tokens; the trainer drops column 0, which is a prompt token
    expected_tokens = {"grpo": tokens, "dr_grpo": 8 * ROWS, "gspo": ROWS}
    for estimator, (loss, num_tokens, grad_norm, metrics) in results[0].items():
        assert num_tokens == expected_tokens[estimator], estimator
        assert metrics["tokens"] == tokens and metrics["sequences"] == ROWS
        assert math.isfinite(loss) and grad_norm > 0
        assert metrics["loss"] == loss
        # off-policy gap is exactly 0.05 per token; TIS weight exp(0.05) is below the cap
        assert abs(metrics["logprob_diff_abs"] - 0.05) < 1e-5
        assert abs(metrics["tis_weight"] - math.exp(0.05)) < 1e-5


def _mini_batch_rank():
    """Two trainers from the same seed: one takes `train_step(..., mini_batches=2)`, the other two
    plain steps on the row halves (global_batch_size = half). Same parameters after, bit for bit;
    the second mini-batch sees ratios != 1 against the old logprobs, so PPO's clip acts."""
    from moe_rl.algorithms import AlgorithmConfig, make_policy_loss, policy_metrics
    from moe_rl.config import OptimizerConfig, TrainerConfig
    from moe_rl.trainer.megatron_trainer import MegatronTrainer
    from moe_rl.trainer.microbatches import split_rows

    hf_config = tiny_models.hf_config(tiny_models.QWEN3_MOE_SMALL, vocab_size=VOCAB)
    optimizer = OptimizerConfig(lr=0.05)
    whole = MegatronTrainer(
        TrainerConfig(world_size=2, global_batch_size=ROWS, micro_batch_size=1, optimizer=optimizer), hf_config
    )
    generator = torch.Generator().manual_seed(0)
    mask = torch.zeros(ROWS, SEQ, dtype=torch.long)
    mask[:, PROMPT:] = 1
    batch = {
        "tokens": torch.randint(0, VOCAB, (ROWS, SEQ), generator=generator),
        "loss_mask": mask,
        "advantages": torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None].expand(ROWS, SEQ).contiguous(),
    }
    batch["old_logprobs"] = torch.cat([torch.zeros(ROWS, 1), whole.forward_logprobs(batch)], dim=1)
    loss = make_policy_loss(AlgorithmConfig(off_policy="none", clip_low=0.01, clip_high=0.01))
    result = whole.train_step(batch, loss, mini_batches=2)
    halves = MegatronTrainer(
        TrainerConfig(world_size=2, global_batch_size=ROWS // 2, micro_batch_size=1, optimizer=optimizer), hf_config
    )
    second = [halves.train_step(split_rows(batch, 2, i), loss) for i in range(2)][1]
    same = all(torch.equal(a, b) for a, b in zip(whole.model.parameters(), halves.model.parameters()))
    return (result.step, same, policy_metrics(second.sums, second.num_tokens)["clip_fraction"], result.num_tokens)


def test_ppo_mini_batches_are_optimizer_steps_on_row_blocks():
    step, same, clip_fraction, tokens = spawn(_mini_batch_rank, 2)[0]
    assert step == 2 and same
    assert clip_fraction > 0  # the first step moved the policy: the second mini-batch's ratios clip
    assert tokens == ROWS * (SEQ - PROMPT)
