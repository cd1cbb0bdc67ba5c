"""Context parallelism (trainer.cp) gives CP1's logprobs, losses and gradients.

Two 2-rank gloo worlds load one HF checkpoint: the reference, DP2 x EP2, and CP2 x EP2 (one DP
replica whose two CP ranks each hold chunks r and 2cp-1-r of every sequence; the EP group spans the
CP ranks). Each runs the same steps (lr 1e-30: Adam moves no fp32 weight) on test_token_budget's
batch of very unequal rows, padded and by token budget: every logprob at a real position, the loss,
the token count and every parameter's summed gradient (DDP main_grad, reduced over DP x CP) must
match. In exact arithmetic they are equal: the CP world computes every token's attention over the
same keys, and its gradients are the same per-token terms summed over other ranks. Only the fp32
summation order differs (attention rows split over ranks, K/V gradients summed over CP, the
parameters' over DP x CP instead of DP), so test_token_budget's tolerance holds: 1e-4 of a
parameter's largest gradient entry (n u sum|x| with n ~ 400 terms) and 1e-5 on a logprob.

Cases: token-mean with TIS, seq-mean-token-mean (GSPO: a per-row ratio over tokens held by both CP
ranks), R3 (the replayed experts split with the same chunking). Attention: the local spec through
`parallel.eager_attention` (what the CPU demo runs), and the TE spec through the stand-in's CP
attention (TE's all_gather communication), packed (THD, each row padded to 2 x cp) and not. A
DeepSeek-V3 (MLA) with a trained MTP layer: megatron-core rolls the MTP labels across the CP chunks.
On megatron-core 0.19 `process_mtp_loss` rescales each micro-batch's MTP loss by its loss tokens
before / after the one-token shift counted on each CP rank's own chunks, so the MTP gradient depends
on the chunking (on this batch's ~10-token chunks by ~10%; by ~1/chunk length in general): there the
MTP case checks logprobs, loss and token counts only.
"""

import pytest
import torch
from test_lora_te import under_te
from test_packed_sequences import (
    FP32,
    Tolerance,
    _mtp_tokens_weigh_alike,
    bf16_tolerance,
    loaded_trainer,
    run_paths,
    save_model,
)
from test_token_budget import BUDGETS, LAYERS, LENGTHS, compare, make_batch, real_positions

from parallel.world import spawn

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

PATHS = {  # name: (max_tokens_per_microbatch, pack_sequences)
    "padded": (None, False),
    "budget": (BUDGETS[1], False),
}
PACKED_PATHS = {**PATHS, "packed": (BUDGETS[0], True), "packed-small": (BUDGETS[2], True)}
MTP_ROUTING = (2, 8)  # DeepSeek-V3 test model: routing rows for both layers, 8 routed experts


def _rank(hf_dir: str, layout: dict, paths: dict, case_names: list[str], mtp: bool = False, precision: str = "fp32"):
    packs = any(pack for _, pack in paths.values())
    trainer, config = loaded_trainer(hf_dir, layout, mtp, precision, pack_sequences=packs)
    full = make_batch(*MTP_ROUTING) if mtp else make_batch()
    full = {key: value.to(trainer.device or "cpu") for key, value in full.items()}
    return run_paths(trainer, config, full, paths, case_names)


def check(reference: list[dict], context: list[dict], mtp: bool = False, tol: Tolerance = FP32) -> None:
    """Rank r of the CP world against rank r mod the reference's size (the same EP / ETP rank: the
    same experts and shards)."""
    real = real_positions()
    for rank, cp in enumerate(context):
        ref = reference[rank % len(reference)]
        for path, values in cp["logprobs"].items():
            assert values.shape == (len(LENGTHS), max(LENGTHS) - 1)  # the batch's order and width
            error = float((values[real] - ref["logprobs"][path][real]).abs().max())
            assert error <= tol.logprob, (path, error)
        for name, runs in cp["cases"].items():
            for path, (loss, tokens, grads, mtp_loss) in runs.items():
                r_loss, r_tokens, r_grads, r_mtp_loss = ref["cases"][name][path]
                assert any(float(g.abs().max()) > 0 for g in r_grads.values()), name
                assert tokens == r_tokens, (name, path)  # the normaliser counted once over the CP ranks
                assert abs(loss - r_loss) <= tol.loss_rel * abs(r_loss) + tol.loss_abs, (name, path, loss, r_loss)
                if not mtp or _mtp_tokens_weigh_alike():
                    compare(r_grads, grads, tol.grad_of_max)
                if mtp:  # the MTP layer trained, its gradients compared above
                    assert any(float(g.abs().max()) > 0 for n, g in grads.items() if ".mtp." in f".{n}")
                    # megatron-core logs CP ranks' chunk means, not the micro-batch's: none reported
                    assert mtp_loss is None and r_mtp_loss is not None, (name, path)


CASES = ["token-mean+tis", "seq-mean-token-mean", "r3"]


def test_cp2_equals_cp1_on_the_local_spec(tmp_path):
    """What the CPU demo runs: megatron-core's local spec with the eager CP attention."""
    hf_dir = str(save_model(tmp_path / "hf"))
    reference = spawn(_rank, 2, hf_dir, {"ep": 2}, PATHS, CASES)
    check(reference, spawn(_rank, 2, hf_dir, {"cp": 2, "ep": 2}, PATHS, CASES))


def test_cp2_under_tensor_and_sequence_parallel(tmp_path):
    """TP2 + SP x CP2 on 4 ranks against TP2 + SP: sequences padded to 2 x cp x tp, each CP chunk
    split over the TP ranks (R3 rows too)."""
    hf_dir = str(save_model(tmp_path / "hf"))
    layout = {"tp": 2, "sequence_parallel": True}
    reference = spawn(_rank, 2, hf_dir, layout, PATHS, ["token-mean+tis", "r3"])
    context = spawn(_rank, 4, hf_dir, {**layout, "world_size": 4, "cp": 2}, PATHS, ["token-mean+tis", "r3"])
    check(reference, context)


def test_cp2_equals_cp1_on_the_te_spec_packed(tmp_path):
    """The TE spec (stand-in: TE's all_gather CP attention, sbhd and thd): padded, by budget and packed,
    each packed row padded to 2 x cp; at the small budget padding micro-batches run too."""
    hf_dir = str(save_model(tmp_path / "hf"))
    reference = spawn(under_te, 2, _rank, hf_dir, {"ep": 2}, PACKED_PATHS, CASES, fresh=True)
    check(reference, spawn(under_te, 2, _rank, hf_dir, {"cp": 2, "ep": 2}, PACKED_PATHS, CASES, fresh=True))


def test_cp2_with_mla_and_a_trained_mtp_layer(tmp_path):
    """DeepSeek-V3 (MLA, eager attention with its q/k and v head sizes) with one MTP layer trained:
    the MTP labels and loss mask roll across CP chunks (megatron-core's roll_tensor)."""
    hf_dir = str(save_model(tmp_path / "hf", mtp=True))
    reference = spawn(_rank, 2, hf_dir, {"ep": 2}, PATHS, ["token-mean+tis", "r3"], True)
    check(reference, spawn(_rank, 2, hf_dir, {"cp": 2, "ep": 2}, PATHS, ["token-mean+tis", "r3"], True), mtp=True)


@pytest.mark.gpu_te
def test_cp2_with_the_real_transformer_engine(tmp_path):
    """What the stand-in stands for: TE's CP attention (megatron's default p2p ring), sbhd and thd, on
    two GPUs (NCCL takes one rank per GPU) against one GPU, in bf16 (TE's thd attention runs no fp32),
    within twice test_precision's bf16 bounds."""
    pytest.importorskip("transformer_engine")
    if torch.cuda.device_count() < 2:
        pytest.skip("CP2 needs two CUDA GPUs")
    hf_dir = str(save_model(tmp_path / "hf"))
    reference = spawn(_rank, 1, hf_dir, {"world_size": 1}, PACKED_PATHS, CASES, False, "bf16")
    context = spawn(_rank, 2, hf_dir, {"cp": 2}, PACKED_PATHS, CASES, False, "bf16")
    real = real_positions()
    check(reference, context, tol=bf16_tolerance(LAYERS, reference[0]["logprobs"]["padded"][real]))
