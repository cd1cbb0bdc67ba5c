"""LoRA import and export for Mixtral (w1/w3/w2 experts) and DeepSeek-V3 (MLA's q_a/q_b/kv_a/kv_b
projections, or q_proj without q LoRA, with rotary rows interleaved or in halves; shared and routed
experts), the families test_lora's GLM-4.5 does not cover.

The oracle is the LoRA update itself applied to the HF checkpoint on disk, W + alpha/r * B A per
adapted weight, loaded by transformers: the trainer's logprobs with the adapter under TP2+EP2+SP
equal that model's, the adapter exports back bit for bit, and the merged export equals the
merged checkpoint. Every target the model has is adapted (the default `target_modules`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from parallel.world import spawn
from tests.tiny_models import DEEPSEEK_V3, MIXTRAL, hf_config, megatron_refusal, save_random_model

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

RANK, ALPHA = 2, 3.0
LAYOUT = dict(world_size=4, tp=2, ep=2, etp=1, sequence_parallel=True)
MLA = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
EXPERTS = ["gate_proj", "up_proj", "down_proj"]
FAMILIES = {
    # (model, overrides, HF leaves adapted, leaf -> the leaf whose A it shares: one Megatron linear)
    "mixtral": (
        MIXTRAL,
        {},
        ["q_proj", "k_proj", "v_proj", "o_proj", "w1", "w3", "w2"],
        {"k_proj": "q_proj", "v_proj": "q_proj", "w3": "w1"},
    ),
    "deepseek_v3": (DEEPSEEK_V3, {}, [*MLA, *EXPERTS], {"up_proj": "gate_proj"}),
    # no q LoRA (q_proj) and rotary rows stored in halves: B's rows are re-interleaved like the weight's
    "deepseek_v3_q_proj_halves": (
        DEEPSEEK_V3,
        dict(q_lora_rank=None, rope_interleave=False),
        ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", *EXPERTS],
        {"up_proj": "gate_proj"},
    ),
}


def _config(family: str):
    base, overrides, _, _ = FAMILIES[family]
    return hf_config(base, num_hidden_layers=2, **overrides)  # DeepSeek-V3: a dense layer, then MoE


def _adapter_and_merged(hf_dir: Path, family: str, adapter_dir: Path, merged_dir: Path) -> None:
    """A random per-expert PEFT adapter on every target leaf of the checkpoint, and the checkpoint
    with that adapter merged in by hand."""
    from safetensors.torch import load_file, save_file

    _, _, leaves, shared_a = FAMILIES[family]
    base = load_file(str(hf_dir / "model.safetensors"))
    names = sorted(n for n in base if n.endswith(".weight") and n.split(".")[-2] in leaves)
    generator = torch.Generator().manual_seed(5)
    adapter, merged = {}, dict(base)
    for name in sorted(names, key=lambda n: n.split(".")[-2] in shared_a):  # owners of a shared A first
        module, (out_features, in_features) = name[: -len(".weight")], base[name].shape
        parent, leaf = module.rsplit(".", 1)
        if leaf in shared_a:
            a = adapter[f"base_model.model.{parent}.{shared_a[leaf]}.lora_A.weight"].clone()
        else:
            a = torch.randn(RANK, in_features, generator=generator) / in_features**0.5
        b = torch.randn(out_features, RANK, generator=generator) * 0.3
        adapter[f"base_model.model.{module}.lora_A.weight"] = a
        adapter[f"base_model.model.{module}.lora_B.weight"] = b
        merged[name] = base[name] + ALPHA / RANK * b @ a
    adapter_dir.mkdir(parents=True)
    save_file(adapter, str(adapter_dir / "adapter_model.safetensors"))
    config = dict(peft_type="LORA", task_type="CAUSAL_LM", r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, bias="none")
    (adapter_dir / "adapter_config.json").write_text(json.dumps({**config, "target_modules": leaves}))
    merged_dir.mkdir(parents=True)
    for f in ("config.json", "generation_config.json"):
        if (hf_dir / f).exists():
            (merged_dir / f).write_text((hf_dir / f).read_text())
    save_file(merged, str(merged_dir / "model.safetensors"), metadata={"format": "pt"})


def _trainer_side(root: str, tokens: torch.Tensor, families: list[str], layouts: list[dict]) -> dict:
    """Rank function, one world: per family and layout, import base + adapter, logprobs, export
    the adapter and the merged model (into `<root>/<family>/out<i>`)."""
    return {
        (family, i): _family_side(family, f"{root}/{family}", f"out{i}", tokens, layout)
        for family in families
        for i, layout in enumerate(layouts)
    }


def _family_side(family: str, root: str, out: str, tokens: torch.Tensor, layout: dict):
    import torch.distributed as dist

    from moe_rl.config import TrainerConfig
    from moe_rl.trainer.megatron_trainer import MegatronTrainer
    from parallel.context import uses_transformer_engine
    from parallel.hf_checkpoint import load_hf_config
    from parallel.lora import LoRAConfig, adapters

    trainer = MegatronTrainer(  # every target the model has (the default)
        TrainerConfig(**layout, micro_batch_size=2, global_batch_size=4),
        _config(family),
        lora=LoRAConfig(rank=RANK, alpha=ALPHA),
    )
    trainer.load_hf_weights(f"{root}/hf")
    trainer.load_adapter(f"{root}/adapter")
    logprobs = trainer.forward_logprobs({"tokens": tokens, "loss_mask": torch.ones_like(tokens)})
    trainer.save_adapter(f"{root}/{out}/adapter")
    trainer.save_hf_checkpoint(f"{root}/{out}/merged", load_hf_config(f"{root}/hf"))
    spec = dict(
        te=uses_transformer_engine(trainer.model.module),
        duplicated=sorted({n.split(".")[-2] for n, a in adapters(trainer.model.module).items() if a.replicated}),
    )
    return logprobs.numpy().copy() if dist.get_rank() == 0 else None, spec


def _prepare(tmp_path: Path, families: list[str], tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per family: the HF model, the adapter, the merged reference; returns its logprobs."""
    from transformers import AutoModelForCausalLM

    expected = {}
    for family in families:
        hf_dir = save_random_model(_config(family), tmp_path / family / "hf")
        _adapter_and_merged(hf_dir, family, tmp_path / family / "adapter", tmp_path / family / "merged_reference")
        reference = AutoModelForCausalLM.from_pretrained(tmp_path / family / "merged_reference", dtype=torch.float32)
        with torch.no_grad():
            logits = reference.eval()(tokens).logits
        expected[family] = torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0]
    return expected


def _check(tmp_path: Path, results: dict, expected: dict) -> None:
    from safetensors.torch import load_file

    for (family, i), (logprobs, _) in results.items():
        root, out, where = tmp_path / family, tmp_path / family / f"out{i}", (family, i)
        assert (torch.from_numpy(logprobs) - expected[family]).abs().max() < 1e-4, where
        original = load_file(str(root / "adapter" / "adapter_model.safetensors"))
        exported = load_file(str(out / "adapter" / "adapter_model.safetensors"))
        assert exported.keys() == original.keys(), where
        assert all(torch.equal(exported[k], original[k]) for k in original), where  # PEFT -> Megatron -> PEFT
        targets = json.loads((out / "adapter" / "adapter_config.json").read_text())["target_modules"]
        assert sorted(targets) == sorted(FAMILIES[family][2]), where  # what SGLang's --lora-target-modules takes
        merged = {k: v for f in sorted((out / "merged").glob("*.safetensors")) for k, v in load_file(f).items()}
        merged_reference = load_file(str(root / "merged_reference" / "model.safetensors"))
        assert merged.keys() == merged_reference.keys(), where
        assert max((merged[k] - merged_reference[k]).abs().max().item() for k in merged) < 1e-6, where


def _supported(families: list[str]) -> tuple[list[str], dict[str, str]]:
    """(the families the installed megatron-core builds, {refused family: the bridge's refusal})."""
    refused = {family: why for family in families if (why := megatron_refusal(_config(family)))}
    return [f for f in families if f not in refused], refused


def _skip_refused(refused: dict[str, str]) -> None:
    """After checking the supported families: report the refused ones as skipped, with the reason."""
    if refused:
        pytest.skip(f"checked the others; refused on this megatron-core: {refused}")


def test_adapter_import_and_export_for_mixtral_and_deepseek_v3(tmp_path):
    tokens = torch.randint(0, 256, (4, 12), generator=torch.Generator().manual_seed(1))
    families, refused = _supported(list(FAMILIES))
    expected = _prepare(tmp_path, families, tokens)
    results = spawn(_trainer_side, 4, str(tmp_path), tokens, families, [LAYOUT])[0]
    _check(tmp_path, results, expected)
    assert all(spec == dict(te=False, duplicated=[]) for _, spec in results.values())  # the local spec
    _skip_refused(refused)


def test_mla_adapters_on_the_transformer_engine_spec(tmp_path):
    """DeepSeek-V3 on TE's spec (the stand-in of test_lora_te): the down projections are duplicated
    TELinear (adapters whole on every rank), the up projections fuse the latent norms
    (TELayerNormColumnParallelLinear), experts are grouped; under TP2+SP and EP2."""
    from test_lora_te import under_te

    families, refused = _supported(["deepseek_v3", "deepseek_v3_q_proj_halves"])
    layouts = [dict(world_size=2, tp=2, sequence_parallel=True), dict(world_size=2, ep=2)]
    tokens = torch.randint(0, 256, (4, 12), generator=torch.Generator().manual_seed(1))
    expected = _prepare(tmp_path, families, tokens)
    results = spawn(under_te, 2, _trainer_side, str(tmp_path), tokens, families, layouts, fresh=True)[0]
    _check(tmp_path, results, expected)
    for (family, _), (_, spec) in results.items():
        down = ["linear_kv_down_proj"] if family.endswith("halves") else ["linear_kv_down_proj", "linear_q_down_proj"]
        assert spec == dict(te=True, duplicated=sorted(down)), (family, spec)
    _skip_refused(refused)
