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

MTP: a TE-spec DeepSeek-V3 (MLA attention, which runs thd through TE's attention) with one MTP layer
trained (mtp_loss_weight 0.3). megatron-core shifts the MTP layer's inputs, labels and loss mask by
one token within each cu_seqlens segment; every other row's prompt is a single token, so its first
trained label sits right after a row boundary and a shift across the boundary would train the
previous row's last MTP position on it. Logprobs, gradients and the MTP loss (compared between runs
of the same micro-batches: it is a mean of per-micro-batch means) must match. On megatron-core 0.19
the MTP gradients depend on the micro-batches themselves (`_mtp_tokens_weigh_alike`), so there
they are compared only between packed and unpacked runs of the same micro-batches.
"""

import dataclasses
import math
from dataclasses import dataclass
from importlib.metadata import version

import pytest
import torch
from test_lora_te import under_te
from test_precision import bf16_grad_tol, bf16_logprob_tol, logprob_scale
from test_token_budget import BUDGETS, LAYERS, LENGTHS, RTOL_OF_MAX, VOCAB, compare, make_batch, real_positions

from moe_rl.trainer.microbatches import budget_plan
from parallel.world import spawn
from tests import tiny_models

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

PATHS = {  # name: (max_tokens_per_microbatch, pack_sequences)
    "padded": (None, False),
    "budget": (BUDGETS[0], False),
    "packed": (BUDGETS[0], True),
    "packed-small": (BUDGETS[2], True),  # at DP2 a rank runs padding micro-batches
}
# With MTP each packed path is also compared with the unpacked path that cuts the same micro-batches.
MTP_PATHS = {**PATHS, "budget-small": (BUDGETS[2], False)}
SAME_MICROBATCHES = {"packed": "budget", "packed-small": "budget-small"}
# DeepSeek-V3: a dense and an MoE layer; head sizes multiples of 8 (q/k 16 + 8, v 16), as TE's
# fused attention needs on a GPU
MTP_MODEL = dict(num_hidden_layers=2, num_nextn_predict_layers=1, v_head_dim=16)
MTP_ROUTING = (2, 8)  # routing rows for both layers (the dense one's unused), 8 routed experts


def save_model(path, mtp: bool = False):
    if not mtp:
        config = tiny_models.hf_config(tiny_models.QWEN3_MOE_SMALL, vocab_size=VOCAB)
        return tiny_models.save_random_model(config, path)
    from safetensors.torch import load_file, save_file

    config = tiny_models.hf_config(tiny_models.DEEPSEEK_V3, **MTP_MODEL)
    tiny_models.save_random_model(config, path)
    (file,) = path.glob("*.safetensors")  # transformers saves no MTP layer: add DeepSeek's
    save_file(tiny_models.with_mtp_layer(load_file(file), config.to_dict()), str(file), metadata={"format": "pt"})
    return path


def _rank(hf_dir: str, layout: dict, case_names: list[str], mtp: bool = False, precision: str = "fp32"):
    from parallel.context import uses_transformer_engine

    trainer, config = loaded_trainer(hf_dir, layout, mtp, precision, pack_sequences=True)
    assert uses_transformer_engine(trainer.model)
    full = make_batch(*MTP_ROUTING) if mtp else make_batch()
    if mtp:  # every other row's prompt is one token: its first trained label follows a row boundary
        full["loss_mask"][::2, 1] = 1
    full = {key: value.to(trainer.device or "cpu") for key, value in full.items()}
    return run_paths(trainer, config, full, MTP_PATHS if mtp else PATHS, case_names)


def loaded_trainer(hf_dir: str, layout: dict, mtp: bool, precision: str, pack_sequences: bool):
    """(trainer, its config) on `hf_dir`'s weights for the path comparisons: 2 ranks unless `layout`
    says otherwise, R3, lr 1e-30 (Adam moves no fp32 weight), a trained MTP layer with `mtp`;
    `pack_sequences` is checked at construction (the TE spec)."""
    from moe_rl.config import OptimizerConfig, TrainerConfig
    from moe_rl.trainer.megatron_trainer import MegatronTrainer
    from parallel.hf_checkpoint import load_hf_config

    config = TrainerConfig(
        **{"world_size": 2, **layout},
        global_batch_size=len(LENGTHS),
        micro_batch_size=2,
        routing_replay=True,
        max_tokens_per_microbatch=BUDGETS[0],
        pack_sequences=pack_sequences,
        mtp_loss_weight=0.3 if mtp else 0.0,
        precision=precision,
        optimizer=OptimizerConfig(lr=1e-30, clip_grad=0.0),
    )
    trainer = MegatronTrainer(config, load_hf_config(hf_dir))
    trainer.load_hf_weights(hf_dir)
    return trainer, config


def run_paths(trainer, config, full: dict, paths: dict, case_names: list[str]) -> dict:
    """From the same weights (lr 1e-30), on the batch `full` (routing rows included; R3 uses them):
    every path's logprobs ({"logprobs": {path: [B, S-1]}}), and per case every path's (loss, tokens,
    summed gradients, MTP loss) ({"cases": {case: {path: ...}}}). `paths`: {name: (budget, pack)}."""
    from moe_rl.algorithms import AlgorithmConfig, make_policy_loss

    natural = {key: value for key, value in full.items() if key != "routed_experts"}

    def use(path: str) -> None:
        budget, pack = paths[path]
        trainer.config = dataclasses.replace(config, max_tokens_per_microbatch=budget, pack_sequences=pack)

    logprobs = {}
    for path in paths:
        use(path)
        logprobs[path] = trainer.forward_logprobs(natural)
    old = torch.cat([logprobs["padded"].new_zeros(len(LENGTHS), 1), logprobs["padded"]], dim=1)
    natural["old_logprobs"] = full["old_logprobs"] = old
    cases = {
        "token-mean+tis": (AlgorithmConfig(), natural),
        "seq-mean-token-mean": (AlgorithmConfig(advantage_estimator="gspo"), natural),
        "r3": (AlgorithmConfig(), full),
    }
    out = {"cases": {}, "logprobs": {path: values.cpu() for path, values in logprobs.items()}}
    for name in case_names:
        algorithm, batch = cases[name]
        runs = {}
        for path in paths:
            use(path)
            result = trainer.train_step(batch, make_policy_loss(algorithm))
            params = trainer.gpt_model.named_parameters()
            grads = {n: p.main_grad.detach().cpu().clone() for n, p in params if p.requires_grad}
            runs[path] = (result.loss, result.num_tokens, grads, result.mtp_loss)
        out["cases"][name] = runs
    return out


@dataclass(frozen=True)
class Tolerance:
    """How far two paths' results may be apart."""

    logprob: float
    """|a - b| of a logprob at a real position; an MTP loss, a mean of cross entropies, too."""
    loss_rel: float
    loss_abs: float
    """|a - b| of the loss <= loss_rel |b| + loss_abs."""
    grad_of_max: float
    """|a - b| of a gradient entry, as a fraction of the parameter's largest entry (`compare`)."""


FP32 = Tolerance(logprob=1e-5, loss_rel=1e-5, loss_abs=1e-7, grad_of_max=RTOL_OF_MAX)
"""fp32: only the summation order differs (test_token_budget)."""


def bf16_tolerance(layers: int, logprobs: torch.Tensor) -> Tolerance:
    """bf16: each path lies within test_precision's bf16 bounds of the exact result, so two paths
    within twice them (`logprobs`: one path's, for the logits' scale). The loss is a token mean of
    advantage (|A| <= 1) x ratio terms, each ratio as far off as its logprob."""
    logprob = 2 * bf16_logprob_tol(layers, logprob_scale(logprobs))
    return Tolerance(logprob=logprob, loss_rel=0.0, loss_abs=logprob, grad_of_max=2 * bf16_grad_tol(layers))


def check(results, mtp: bool = False, precision: str = "fp32") -> None:
    width = max(LENGTHS)
    real = real_positions()
    layers = MTP_MODEL["num_hidden_layers"] + MTP_MODEL["num_nextn_predict_layers"] if mtp else LAYERS
    for rank in results:
        logprobs = rank["logprobs"]
        tol = FP32 if precision == "fp32" else bf16_tolerance(layers, logprobs["padded"][real])
        for path in logprobs:
            assert logprobs[path].shape == (len(LENGTHS), width - 1)
            error = float((logprobs[path][real] - logprobs["padded"][real]).abs().max())
            assert error <= tol.logprob, (path, error, tol.logprob)
        assert not logprobs["packed"][~real].any()  # packed: 0 past each row's length
        for name, runs in rank["cases"].items():
            loss, tokens, grads, _ = runs["padded"]
            assert any(float(g.abs().max()) > 0 for g in grads.values()), name
            for path, (p_loss, p_tokens, p_grads, _) in runs.items():
                assert p_tokens == tokens, (name, path)
                assert abs(p_loss - loss) <= tol.loss_rel * abs(loss) + tol.loss_abs, (name, path, p_loss, loss)
                if not mtp or _mtp_tokens_weigh_alike():  # else check_mtp compares equal micro-batches
                    compare(grads, p_grads, tol.grad_of_max)
            if mtp:
                check_mtp(name, runs, tol)


def check_mtp(name: str, runs: dict, tol: Tolerance) -> None:
    """The MTP layer was trained, and each packed path's MTP loss and gradients equal those of the
    unpacked path with the same micro-batches. The MTP loss is a mean of per-token cross entropies,
    each as far from the other path's as a logprob is (`tol.logprob`): their mean no further."""
    assert any(float(g.abs().max()) > 0 for n, g in runs["padded"][2].items() if ".mtp." in f".{n}"), name
    assert runs["packed"][3] is not None, name  # no padding micro-batch at BUDGETS[0]: a loss to compare
    for path, (*_, mtp_loss) in runs.items():  # near-uniform model: ~ln(vocab); padding micro-batches count for none
        assert mtp_loss is None or abs(mtp_loss - math.log(VOCAB)) < 0.5, (name, path, mtp_loss)
    for packed, unpacked in SAME_MICROBATCHES.items():
        loss, tokens, grads, mtp_loss = runs[unpacked]
        p_loss, p_tokens, p_grads, p_mtp_loss = runs[packed]
        assert p_tokens == tokens and abs(p_loss - loss) <= tol.loss_rel * abs(loss) + tol.loss_abs, (name, packed)
        assert (p_mtp_loss is None) == (mtp_loss is None), (name, packed, p_mtp_loss, mtp_loss)
        if mtp_loss is not None:
            assert abs(p_mtp_loss - mtp_loss) <= tol.logprob, (name, packed, p_mtp_loss, mtp_loss)
        compare(grads, p_grads, tol.grad_of_max)


def _mtp_tokens_weigh_alike() -> bool:
    """megatron-core 0.19 scales each micro-batch's MTP loss by its loss tokens before / after the
    one-token shift (`process_mtp_loss`): with a one-token prompt (the shift drops that row's first
    trained label) that factor depends on which rows share a micro-batch, so only paths with the
    same micro-batches give the same MTP gradients. 0.16 weighs every MTP token alike."""
    return int(version("megatron-core").split(".")[1]) < 19


def test_the_small_budget_runs_padding_microbatches():
    """What the packed-small path is for: at DP2 one rank runs micro-batches without rows."""
    plan = budget_plan(LENGTHS, 2, PATHS["packed-small"][0])
    assert any(not rows for share in plan for rows in share)


def test_packed_gradients_equal_the_token_budget_and_padded_paths(tmp_path):
    hf_dir = str(save_model(tmp_path / "hf"))
    check(spawn(under_te, 2, _rank, hf_dir, {"ep": 2}, ["token-mean+tis", "seq-mean-token-mean", "r3"], fresh=True))


def test_packed_with_an_mtp_layer(tmp_path):
    """DeepSeek-V3 (MLA) with a trained MTP layer: MTP inputs, labels and loss mask shift within
    each packed row."""
    hf_dir = str(save_model(tmp_path / "hf", mtp=True))
    check(spawn(under_te, 2, _rank, hf_dir, {"ep": 2}, ["token-mean+tis", "r3"], True, fresh=True), mtp=True)


def test_packed_under_sequence_parallel(tmp_path):
    """TP2 + SP: the packed sequence is padded to the TP multiple (a padding segment of its own)."""
    hf_dir = str(save_model(tmp_path / "hf"))
    layout = {"tp": 2, "sequence_parallel": True}
    check(spawn(under_te, 2, _rank, hf_dir, layout, ["token-mean+tis", "r3"], fresh=True))


def test_packed_in_bf16(tmp_path):
    """trainer.precision bf16, what GPUs pack in (TE's thd attention takes no fp32): the same
    comparison within bf16's tolerance."""
    hf_dir = str(save_model(tmp_path / "hf"))
    results = spawn(under_te, 2, _rank, hf_dir, {"ep": 2}, ["token-mean+tis", "r3"], False, "bf16", fresh=True)
    check(results, precision="bf16")


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
    kernels against its sbhd ones): what the stand-in stands for. In bf16: TE's attention runs thd
    only in bf16/fp16 (fp32 packing is refused, `TrainerConfig.check_packing_precision`)."""
    pytest.importorskip("transformer_engine")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    hf_dir = str(save_model(tmp_path / "hf"))
    cases = ["token-mean+tis", "seq-mean-token-mean", "r3"]
    check(spawn(_rank, 1, hf_dir, {"world_size": 1}, cases, False, "bf16"), precision="bf16")
    hf_dir = str(save_model(tmp_path / "hf-mtp", mtp=True))
    check(spawn(_rank, 1, hf_dir, {"world_size": 1}, ["token-mean+tis", "r3"], True, "bf16"), True, "bf16")
