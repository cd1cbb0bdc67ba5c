"""Packed sequences (trainer.pack_sequences) give the token-budget and padded paths' logprobs and
gradients, on megatron-core's Transformer Engine spec through the CPU stand-in (te_standin, whose
DotProductAttention runs thd per cu_seqlens segment; RoPE is megatron's own, per segment).

One 2-rank gloo world, DP=2 x EP=2, a TE-spec tiny Qwen3-MoE loaded from one checkpoint. One
trainer runs the same train step per case padded (budget None), by token budget, and packed at
two budgets (one of them so small that a DP rank runs a padding micro-batch), from the same
weights (lr 1e-30: Adam moves no fp32 weight); every parameter's summed gradient is compared with
test_token_budget's tolerance (1e-4 of the largest entry, from n u sum|x| with n ~ 400 fp32 terms).
Cases: token-mean with TIS, seq-mean-token-mean (GSPO: per-row losses read the unpacked rows),
R3 (routing replay rows packed in the model's token order). Also TP2 + sequence parallel (the
packed length padded to the TP multiple) and the refusals (local spec, no budget).
"""

import dataclasses

import pytest
import torch
from test_lora_te import under_te
from test_token_budget import BUDGETS, LENGTHS, VOCAB, compare, make_batch, real_positions

from parallel.world import spawn
from tests import tiny_models

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

PATHS = {  # name: (max_tokens_per_microbatch, pack_sequences)
    "padded": (None, False),
    "budget": (BUDGETS[0], False),
    "packed": (BUDGETS[0], True),
    "packed-small": (BUDGETS[1], True),  # a DP rank runs a padding micro-batch
}


def save_model(path):
    return tiny_models.save_random_model(tiny_models.hf_config(tiny_models.QWEN3_MOE_SMALL, vocab_size=VOCAB), path)


def _rank(hf_dir: str, layout: dict, case_names: list[str]):
    from moe_rl.algorithms import AlgorithmConfig, make_policy_loss
    from moe_rl.config import OptimizerConfig, TrainerConfig
    from moe_rl.trainer.megatron_trainer import MegatronTrainer
    from parallel.context import uses_transformer_engine
    from parallel.hf_checkpoint import load_hf_config

    config = TrainerConfig(
        **{"world_size": 2, **layout},
        global_batch_size=len(LENGTHS),
        micro_batch_size=2,
        routing_replay=True,
        max_tokens_per_microbatch=BUDGETS[0],
        pack_sequences=True,  # checked at construction: the TE spec, no MTP
        optimizer=OptimizerConfig(lr=1e-30, clip_grad=0.0),
    )
    trainer = MegatronTrainer(config, load_hf_config(hf_dir))
    assert uses_transformer_engine(trainer.model)
    trainer.load_hf_weights(hf_dir)
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    full = {key: value.to(device) for key, value in make_batch().items()}
    natural = {key: value for key, value in full.items() if key != "routed_experts"}

    def use(path: str) -> None:
        budget, pack = PATHS[path]
        trainer.config = dataclasses.replace(config, max_tokens_per_microbatch=budget, pack_sequences=pack)

    logprobs = {}
    for path in PATHS:
        use(path)
        logprobs[path] = trainer.forward_logprobs(natural)
    old = torch.cat([logprobs["padded"].new_zeros(len(LENGTHS), 1), logprobs["padded"]], dim=1)
    natural["old_logprobs"] = full["old_logprobs"] = old
    cases = {
        "token-mean+tis": (AlgorithmConfig(), natural),
        "seq-mean-token-mean": (AlgorithmConfig(advantage_estimator="gspo"), natural),
        "r3": (AlgorithmConfig(), full),
    }
    out = {"cases": {}}
    for name in case_names:
        algorithm, batch = cases[name]
        runs = {}
        for path in PATHS:
            use(path)
            result = trainer.train_step(batch, make_policy_loss(algorithm))
            params = trainer.model.module.named_parameters()
            grads = {n: p.main_grad.detach().cpu().clone() for n, p in params if p.requires_grad}
            runs[path] = (result.loss, result.num_tokens, grads)
        out["cases"][name] = runs
    out["logprobs"] = {path: values.cpu() for path, values in logprobs.items()}
    return out


def check(results) -> None:
    width = max(LENGTHS)
    real = real_positions()
    for rank in results:
        logprobs = rank["logprobs"]
        for path in PATHS:
            assert logprobs[path].shape == (len(LENGTHS), width - 1)
            assert torch.allclose(logprobs[path][real], logprobs["padded"][real], rtol=0, atol=1e-5), path
        assert not logprobs["packed"][~real].any()  # packed: 0 past each row's length
        for name, runs in rank["cases"].items():
            loss, tokens, grads = runs["padded"]
            assert any(float(g.abs().max()) > 0 for g in grads.values()), name
            for path in PATHS:
                p_loss, p_tokens, p_grads = runs[path]
                assert p_tokens == tokens, (name, path)
                assert abs(p_loss - loss) <= 1e-5 * abs(loss) + 1e-7, (name, path, p_loss, loss)
                compare(grads, p_grads)


def test_packed_gradients_equal_the_token_budget_and_padded_paths(tmp_path):
    hf_dir = str(save_model(tmp_path / "hf"))
    check(spawn(under_te, 2, _rank, hf_dir, {"ep": 2}, ["token-mean+tis", "seq-mean-token-mean", "r3"], fresh=True))


def test_packed_under_sequence_parallel(tmp_path):
    """TP2 + SP: the packed sequence is padded to the TP multiple (a padding segment of its own)."""
    hf_dir = str(save_model(tmp_path / "hf"))
    layout = {"tp": 2, "sequence_parallel": True}
    check(spawn(under_te, 2, _rank, hf_dir, layout, ["token-mean+tis", "r3"], fresh=True))


def _refusal(hf_dir: str) -> str:
    from moe_rl.config import TrainerConfig
    from moe_rl.trainer.megatron_trainer import MegatronTrainer
    from parallel.hf_checkpoint import load_hf_config

    config = TrainerConfig(world_size=1, global_batch_size=2, max_tokens_per_microbatch=64, pack_sequences=True)
    try:
        MegatronTrainer(config, load_hf_config(hf_dir))
    except ValueError as error:
        return str(error)
    return "built"


def test_pack_sequences_is_refused_on_the_local_spec(tmp_path):
    """No Transformer Engine (the CPU local spec): a ValueError naming the field and the fix."""
    message = spawn(_refusal, 1, str(save_model(tmp_path / "hf")))[0]
    assert "trainer.pack_sequences=true" in message and "local spec" in message
    assert "pack_sequences=false" in message


@pytest.mark.gpu_te
def test_packed_gradients_with_the_real_transformer_engine(tmp_path):
    """The same comparison on one GPU with the real Transformer Engine (its thd attention and RoPE
    kernels against its sbhd ones): what the stand-in stands for."""
    pytest.importorskip("transformer_engine")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    hf_dir = str(save_model(tmp_path / "hf"))
    check(spawn(_rank, 1, hf_dir, {"world_size": 1}, ["token-mean+tis", "seq-mean-token-mean", "r3"]))
