"""Token-budget micro-batches (trainer.max_tokens_per_microbatch) give the padded path's gradients.

One 2-rank gloo world, DP=2 x EP=2 (the experts split over the two DP ranks, so the all-to-all
needs equal micro-batch counts). One trainer runs the same train step twice per case on a batch
of very unequal rows, padded (budget None) and by token budget, from the same weights (lr 1e-30:
Adam moves no fp32 weight), and every parameter's summed gradient (DDP main_grad, clipping off)
is compared. Cases: token-mean (grpo), seq-mean-token-sum (dr_grpo), seq-mean-token-mean (gspo)
with TIS, KL + MIS, R3 (routing replay), PPO mini-batches; three budgets (`BUDGETS`): one where a
rank splits a micro-batch to match the other's count, one that packs the short tail, one so small
that a DP rank runs padding micro-batches. A PP2 world (1F1B, micro-batches of different widths
between the stages) runs token-mean and R3; LoRA adapters and a trained DeepSeek-V3 MTP layer run
token-mean and R3.
"""

import dataclasses
import math

import pytest
import torch

from parallel.world import spawn
from tests import tiny_models

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

VOCAB, PROMPT = 256, 2
LENGTHS = [40, 38, 36, 3, 5, 4, 9, 3]  # tokens per row: three long rows, a short tail
NUM_EXPERTS, TOPK, LAYERS = 4, 2, 2
# 90: two long rows share a micro-batch; the rank given it alone splits it to match the other's
# count; 48: the long rows alone, the tail packed together; 12: below the longest row (each long
# row goes alone): a rank with fewer micro-batches and no row to split runs padding micro-batches
BUDGETS = (90, 48, 12)

# fp32 tolerance. Each gradient entry is a sum over this rank's ~120 tokens and over the DP ranks
# of per-token terms, each itself a chain of dot products of length <= 256 (vocab) / 64 (MLP).
# The two paths sum in a different order (micro-batch grouping, matmul shapes and so blocking),
# and recursive summation of n terms errs by at most n * u * sum|x_i| (u = 2^-24 = 6e-8): with
# n ~ 120 + 256 ~ 400, that is 2.4e-5 of sum|x_i|, which cancellation makes up to a few times
# max|g|. Hence |a - b| <= 1e-4 * max|g| per parameter (plus 1e-9 absolute for all-zero grads).
RTOL_OF_MAX, ATOL = 1e-4, 1e-9


def make_batch(layers: int = LAYERS, experts: int = NUM_EXPERTS):
    rows, width = len(LENGTHS), max(LENGTHS)
    generator = torch.Generator().manual_seed(5)
    tokens = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros_like(tokens)
    for row, length in enumerate(LENGTHS):
        tokens[row, :length] = torch.randint(1, VOCAB, (length,), generator=generator)
        mask[row, PROMPT:length] = 1
    b, t, layer = torch.meshgrid(torch.arange(rows), torch.arange(width), torch.arange(layers), indexing="ij")
    first = (3 * b + 5 * t + layer) % experts
    second = (first + 1 + (b + t) % (experts - 1)) % experts
    noise = 0.05 * torch.randn(rows, width, generator=generator)
    return {
        "tokens": tokens,
        "loss_mask": mask,
        "advantages": torch.linspace(-1.0, 1.0, rows)[:, None].expand(rows, width).contiguous(),
        "rollout_logprobs": torch.full((rows, width), -math.log(VOCAB)) + noise,
        "ref_logprobs": torch.full((rows, width), -math.log(VOCAB)) - noise,
        "routed_experts": torch.stack([first, second], dim=-1).to(torch.int32),
    }


def _rank(layout: dict, case_names: list[str] | None = None, family: str = "qwen3", lora: bool = False):
    """`family`: "qwen3" (the small Qwen3-MoE) or "mtp" (DeepSeek-V3 with one MTP layer, trained
    with mtp_loss_weight 0.3); `lora`: rank-4 adapters on every layer (only they get gradients)."""
    from moe_rl.algorithms import AlgorithmConfig, make_policy_loss
    from moe_rl.config import OptimizerConfig, TrainerConfig
    from moe_rl.trainer.megatron_trainer import MegatronTrainer
    from parallel.lora import LoRAConfig

    if family == "mtp":
        hf_config = tiny_models.hf_config(tiny_models.DEEPSEEK_V3, num_hidden_layers=2, num_nextn_predict_layers=1)
        routing = (2, 8)  # rows for every layer (the dense first layer's are unused), 8 routed experts
    else:
        hf_config = tiny_models.hf_config(tiny_models.QWEN3_MOE_SMALL, vocab_size=VOCAB)
        routing = (LAYERS, NUM_EXPERTS)
    padded = TrainerConfig(
        world_size=2,
        **layout,
        global_batch_size=len(LENGTHS),
        micro_batch_size=2,
        routing_replay=True,
        max_tokens_per_microbatch=BUDGETS[0],  # built for it (variable_seq_lengths); toggled below
        mtp_loss_weight=0.3 if family == "mtp" else 0.0,
        optimizer=OptimizerConfig(lr=1e-30, clip_grad=0.0),
    )
    trainer = MegatronTrainer(padded, hf_config, lora=LoRAConfig(rank=4, alpha=8) if lora else None)
    full = make_batch(*routing)
    natural = {key: value for key, value in full.items() if key != "routed_experts"}

    def run(budget, step):
        trainer.config = dataclasses.replace(padded, max_tokens_per_microbatch=budget)
        result = step()
        grads = {n: p.main_grad.clone() for n, p in trainer.model.module.named_parameters() if p.requires_grad}
        return result, grads

    # the behaviour policy, both ways: same values at every real position
    logprobs = {}
    for budget in (None, *BUDGETS):
        trainer.config = dataclasses.replace(padded, max_tokens_per_microbatch=budget)
        logprobs[budget] = trainer.forward_logprobs(natural)
    old = torch.cat([torch.zeros(len(LENGTHS), 1), logprobs[None]], dim=1)
    natural["old_logprobs"] = full["old_logprobs"] = old

    cases = {
        "token-mean+tis": (AlgorithmConfig(), natural, 1),
        "seq-mean-token-sum": (AlgorithmConfig(advantage_estimator="dr_grpo", dr_grpo_norm_len=64), natural, 1),
        "seq-mean-token-mean": (AlgorithmConfig(advantage_estimator="gspo"), natural, 1),
        "kl+mis": (AlgorithmConfig(kl_coef=0.1, off_policy="mis", mis_low=0.9, mis_high=1.1), natural, 1),
        "r3": (AlgorithmConfig(), full, 1),
        "mini-batches": (AlgorithmConfig(), natural, 2),
    }
    out = {"logprobs": logprobs, "cases": {}}
    for name, (algorithm, batch, mini_batches) in cases.items():
        if case_names is not None and name not in case_names:
            continue
        loss = make_policy_loss(algorithm)
        runs = {}
        for budget in (None, *BUDGETS):
            result, grads = run(budget, lambda: trainer.train_step(batch, loss, mini_batches=mini_batches))
            runs[budget] = (result.loss, result.num_tokens, result.sums, grads)
        out["cases"][name] = runs
    return out


def compare(reference, other, rtol_of_max: float = RTOL_OF_MAX):
    worst = 0.0
    for name, grad in reference.items():
        bound = rtol_of_max * float(grad.abs().max()) + ATOL
        error = float((other[name] - grad).abs().max())
        assert error <= bound, (name, error, bound)
        worst = max(worst, error / bound)
    return worst


def test_token_budget_gradients_equal_the_padded_path():
    check(spawn(_rank, 2, {"ep": 2}))


def test_token_budget_under_pipeline_parallel():
    """PP2 (1F1B): micro-batches of different widths pass between the stages (variable_seq_lengths)."""
    check(spawn(_rank, 2, {"pp": 2}, ["token-mean+tis", "r3"]))


def test_token_budget_with_lora_and_with_mtp():
    """LoRA adapters on every layer and expert (their gradients), and a DeepSeek-V3 MTP layer
    trained (mtp_loss_weight 0.3; with the small budget a rank runs a padding micro-batch, whose MTP
    loss must weigh nothing): gradients equal the padded path's."""
    check(spawn(_rank, 2, {"ep": 2}, ["token-mean+tis", "r3"], "qwen3", True))
    check(spawn(_rank, 2, {"ep": 2}, ["token-mean+tis", "r3"], "mtp"))


def real_positions() -> torch.Tensor:
    """bool [rows, width - 1]: the model inputs each row really has (its length - 1)."""
    real = torch.zeros(len(LENGTHS), max(LENGTHS) - 1, dtype=torch.bool)
    for row, length in enumerate(LENGTHS):
        real[row, : length - 1] = True
    return real


def check(results):
    width = max(LENGTHS)
    real = real_positions()
    for rank in results:
        logprobs = rank["logprobs"]
        for budget in BUDGETS:
            assert logprobs[budget].shape == (len(LENGTHS), width - 1)  # the batch's order and width
            assert torch.allclose(logprobs[budget][real], logprobs[None][real], rtol=0, atol=1e-5)
        for name, runs in rank["cases"].items():
            loss, tokens, sums, grads = runs[None]
            assert any(float(g.abs().max()) > 0 for g in grads.values()), name
            for budget in BUDGETS:
                b_loss, b_tokens, b_sums, b_grads = runs[budget]
                assert b_tokens == tokens, (name, budget)  # normalisers are exact integers
                assert math.isclose(b_loss, loss, rel_tol=1e-5, abs_tol=1e-7), (name, budget, b_loss, loss)
                assert b_sums["sequences"] == sums["sequences"] and b_sums["tokens"] == sums["tokens"]
                compare(grads, b_grads)
