"""trainer.precision "bf16": Megatron-LM's mixed precision on the CPU trainer (gloo).

One 2-rank world, DP=2 x EP=2, the tiny Qwen3-MoE of test_token_budget loaded from one fp32
checkpoint into an fp32 trainer and a bf16 trainer:
- the bf16 model's parameters are bf16 (inside megatron-core's Float16Module), the optimizer's main
  parameters fp32 and equal to them after the import (the import runs after the optimizer is built);
- the bf16 logprobs agree with the fp32 model's within `bf16_logprob_tol` (derived below), and
  differ from them (bf16 really computes);
- the export (the weight sync's and HF checkpoints' stream) has the fp32 export's HF names and
  shapes, in bf16, and equals the fp32 export rounded to bf16, bit for bit; an HF checkpoint holds
  bf16 tensors and says so (`dtype`);
- a few Adam steps on one fixed batch: the loss is finite and falls, the main parameters stay
  fp32 and the model's bf16 parameters are them rounded;
- a dist checkpoint resumes exactly (the next loss bit-equal), refuses a resume under fp32 with its
  optimizer, and loads into fp32 without it;
- the frozen KL reference is bf16 too (its logprobs equal the policy's at step 0); LoRA adapters
  get fp32 main params (the frozen base none) and train.
PP2 and TP2 + SP train in bf16 with the distributed optimizer (fp32 main-param shards). Packed
sequences in bf16 are compared with unpacked ones through the TE stand-in in test_packed_sequences.
"""

import json
import math

import pytest
import torch
from safetensors import safe_open
from test_token_budget import LAYERS, LENGTHS, VOCAB, make_batch, real_positions

from parallel.world import spawn
from tests import tiny_models

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

LAYOUT = dict(world_size=2, ep=2)
STEPS = 4

# bf16 tolerance. bf16 keeps 8 significant bits: unit roundoff u = 2^-8 = 3.9e-3 (fp32: 2^-24).
# A bf16 model rounds to bf16 every result its layers hand on: per decoder layer its input norm,
# the q/k/v (MLA: low-rank q and kv, their norms) projections, q/k norms, RoPE, attention, output
# projection, residual add, pre-MLP norm, fc1, activation, fc2, the experts' weighted sum and the
# second residual add, about 16; then the final norm and the logits: n = 16 L + 2 roundings on the
# path of a logit. Rounding errors of separate operations are independent and of mean zero to first
# order, so they grow like sqrt(n) u (Higham and Mary, "A new approach to probabilistic rounding
# error analysis", 2019), not n u (the worst case, 6x looser here). A logit then errs by about
# sqrt(n) u times the logits' scale, and a logprob z_t - logsumexp(z) by at most twice the largest
# logit error. The scale is measured: how far the fp32 logprobs stray from the uniform -ln V (0.31
# for this tiny model). L = 2: 0.014; measured 1.5e-3. A weight gradient multiplies a forward
# activation by a backward one, which is rounded at as many points: sqrt(2n) u of the largest entry.
# A packing bug that lets attention cross rows moves logprobs by 0.11 and gradients by 0.56 of
# their largest entry, far outside both.
BF16_UNIT_ROUNDOFF = 2.0**-8


def bf16_roundings(layers: int) -> int:
    return 16 * layers + 2


def logprob_scale(logprobs: torch.Tensor) -> float:
    """The logits' scale: the largest distance of (fp32) logprobs from the uniform -ln V."""
    return float((logprobs + math.log(VOCAB)).abs().max())


def bf16_logprob_tol(layers: int, scale: float) -> float:
    """|bf16 logprob - exact| for a model of `layers` decoder layers (and MTP layers on its path)."""
    return 2 * math.sqrt(bf16_roundings(layers)) * BF16_UNIT_ROUNDOFF * scale


def bf16_grad_tol(layers: int) -> float:
    """|bf16 gradient entry - exact|, as a fraction of the parameter's largest entry."""
    return math.sqrt(2 * bf16_roundings(layers)) * BF16_UNIT_ROUNDOFF


def _trainer(hf_dir: str, precision: str, lora: bool = False):
    from moe_rl.config import OptimizerConfig, TrainerConfig
    from moe_rl.trainer.megatron_trainer import MegatronTrainer
    from parallel.hf_checkpoint import load_hf_config
    from parallel.lora import LoRAConfig

    config = TrainerConfig(
        **LAYOUT,
        precision=precision,
        global_batch_size=len(LENGTHS),
        micro_batch_size=2,
        optimizer=OptimizerConfig(lr=1e-2),
    )
    trainer = MegatronTrainer(config, load_hf_config(hf_dir), lora=LoRAConfig(rank=4, alpha=8) if lora else None)
    trainer.load_hf_weights(hf_dir)
    return trainer


def _main_params(trainer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(model parameter, its fp32 main parameter) pairs of the (plain, chained) optimizer."""
    pairs = []
    for optimizer in trainer.optimizer.chained_optimizers:
        for models, mains in zip(optimizer.float16_groups, optimizer.fp32_from_float16_groups):
            pairs += list(zip(models, mains))
    return pairs


def _export(trainer) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in trainer.export_hf_weights(bucket_bytes=1 << 20)}


def _rank(hf_dir: str, directory: str) -> dict:
    from moe_rl.trainer.checkpoint import load_checkpoint, save_checkpoint
    from parallel.hf_checkpoint import load_hf_config

    batch = {key: value for key, value in make_batch().items() if key in ("tokens", "loss_mask")}
    fp32 = _trainer(hf_dir, "fp32")
    out = {"fp32_logprobs": fp32.forward_logprobs(batch), "fp32_export": _export(fp32)}
    bf16 = _trainer(hf_dir, "bf16")
    out["logprobs"] = bf16.forward_logprobs(batch)
    out["export"] = _export(bf16)
    bf16.save_hf_checkpoint(f"{directory}-hf", load_hf_config(hf_dir))
    out["model_dtypes"] = {p.dtype for p in bf16.gpt_model.parameters()}
    out["wrapped_in"] = type(bf16.model.module).__name__
    pairs = _main_params(bf16)
    out["main_params"] = (len(pairs), sum(1 for _ in bf16.gpt_model.parameters()))
    out["main_dtypes"] = {main.dtype for _, main in pairs}
    out["main_equal_model_at_load"] = all(torch.equal(main, model.float()) for model, main in pairs)
    bf16.build_reference(hf_dir)  # the policy of step 0, in bf16 too
    out["reference_equal"] = torch.equal(bf16.reference_logprobs(batch), out["logprobs"])

    out["losses"] = [bf16.train_step(batch).loss for _ in range(STEPS)]
    out["main_dtypes_after"] = {main.dtype for _, main in _main_params(bf16)}
    out["model_is_rounded_main"] = all(torch.equal(model, main.bfloat16()) for model, main in _main_params(bf16))
    out["main_moved_off_bf16"] = any(not torch.equal(main, model.float()) for model, main in _main_params(bf16))

    save_checkpoint(bf16, directory)
    saved = {name: p.detach().clone() for name, p in bf16.gpt_model.named_parameters()}
    out["continued"] = bf16.train_step(batch).loss
    resumed = _trainer(hf_dir, "bf16")
    load_checkpoint(resumed, directory)
    out["resumed"] = resumed.train_step(batch).loss
    as_fp32 = _trainer(hf_dir, "fp32")
    try:
        load_checkpoint(as_fp32, directory)
        out["fp32_refusal"] = None
    except ValueError as error:
        out["fp32_refusal"] = str(error)
    load_checkpoint(as_fp32, directory, load_optimizer=False)
    out["fp32_loaded"] = as_fp32.step == STEPS and all(
        p.dtype == torch.float32 and torch.equal(p, saved[name].float())
        for name, p in as_fp32.gpt_model.named_parameters()
    )

    lora = _trainer(hf_dir, "bf16", lora=True)  # only the adapters have main params
    adapters = [p for p in lora.gpt_model.parameters() if p.requires_grad]
    out["lora_losses"] = [lora.train_step(batch).loss for _ in range(2)]
    out["lora_main"] = (len(_main_params(lora)), len(adapters), {main.dtype for _, main in _main_params(lora)})
    return out


def test_bf16_trains_with_fp32_main_params_and_exports_bf16(tmp_path):
    hf_dir = tiny_models.save_random_model(
        tiny_models.hf_config(tiny_models.QWEN3_MOE_SMALL, vocab_size=VOCAB), tmp_path / "hf"
    )
    results = spawn(_rank, 2, str(hf_dir), str(tmp_path / "ckpt"))
    real = real_positions()
    for rank, out in enumerate(results):
        assert out["wrapped_in"] == "Float16Module"
        assert out["model_dtypes"] == {torch.bfloat16}
        assert out["main_params"][0] == out["main_params"][1]  # every parameter has a main copy
        assert out["main_dtypes"] == out["main_dtypes_after"] == {torch.float32}
        assert out["main_equal_model_at_load"] and out["reference_equal"]
        error = float((out["logprobs"][real] - out["fp32_logprobs"][real]).abs().max())
        tolerance = bf16_logprob_tol(LAYERS, logprob_scale(out["fp32_logprobs"][real]))
        assert 0 < error <= tolerance, (error, tolerance)
        losses = out["losses"]
        assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0], losses
        assert out["model_is_rounded_main"] and out["main_moved_off_bf16"]
        assert out["resumed"] == out["continued"]
        assert out["fp32_refusal"] and "trainer.precision" in out["fp32_refusal"]
        assert out["fp32_loaded"]
        lora_losses, (mains, adapters, dtypes) = out["lora_losses"], out["lora_main"]
        assert mains == adapters > 0 and dtypes == {torch.float32}
        assert all(math.isfinite(loss) for loss in lora_losses) and lora_losses[1] < lora_losses[0], lora_losses
    source = results[0]
    assert source["export"].keys() == source["fp32_export"].keys() and source["export"]
    for name, tensor in source["export"].items():
        reference = source["fp32_export"][name]
        assert tensor.shape == reference.shape and tensor.dtype == torch.bfloat16, name
        assert torch.equal(tensor, reference.bfloat16()), name
    assert not results[1]["export"]  # only the source receives
    saved = tmp_path / "ckpt-hf"  # an HF checkpoint says its weights are bf16
    assert json.loads((saved / "config.json").read_text())["dtype"] == "bfloat16"
    (shard,) = saved.glob("*.safetensors")
    with safe_open(shard, "pt") as f:
        assert {f.get_slice(name).get_dtype() for name in f.keys()} == {"BF16"}


def _layout_rank(layout: dict) -> tuple[list[float], set]:
    from moe_rl.config import OptimizerConfig, TrainerConfig
    from moe_rl.trainer.megatron_trainer import MegatronTrainer

    optimizer = OptimizerConfig(lr=1e-2, distributed=True)
    config = TrainerConfig(**layout, precision="bf16", global_batch_size=4, optimizer=optimizer)
    trainer = MegatronTrainer(config, tiny_models.hf_config(tiny_models.QWEN3_MOE_SMALL))
    tokens = torch.randint(1, VOCAB, (4, 17), generator=torch.Generator().manual_seed(0))
    batch = {"tokens": tokens, "loss_mask": torch.ones_like(tokens)}
    losses = [trainer.train_step(batch).loss for _ in range(3)]
    # the distributed optimizer steps this rank's shards of the fp32 main params
    mains = {
        p.dtype for o in trainer.optimizer.chained_optimizers for g in o.optimizer.param_groups for p in g["params"]
    }
    return losses, mains


@pytest.mark.parametrize(
    "layout", [dict(world_size=2, pp=2), dict(world_size=2, tp=2, sequence_parallel=True)], ids=["pp2", "tp2-sp"]
)
def test_bf16_with_the_distributed_optimizer(layout):
    """PP2 (bf16 activations between the stages: pipeline_dtype) and TP2 + SP (bf16 all-reduces and
    reduce-scatters), with the distributed optimizer (fp32 main-param shards, what the GPU configs use)."""
    for losses, mains in spawn(_layout_rank, 2, layout):
        assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0], losses
        assert mains == {torch.float32}
