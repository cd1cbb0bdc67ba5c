"""LoRA import and export for Mixtral (w1/w3/w2 experts) and DeepSeek-V3 (MLA attention, shared and
routed experts), the families test_lora's GLM-4.5 does not cover.

The oracle is the LoRA update itself applied to the HF checkpoint on disk, W + alpha/r * B A per
adapted weight, loaded by transformers: the trainer's logprobs with the adapter under TP2+EP2+SP
equal that model's, the adapter exports back bit for bit, and the merged export equals the
merged checkpoint. DeepSeek-V3's MLA projections are not trainer targets (only o_proj is).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from parallel.world import spawn
from tests.tiny_models import DEEPSEEK_V3, MIXTRAL, hf_config, save_random_model

RANK, ALPHA = 2, 3.0
LAYOUT = dict(world_size=4, tp=2, ep=2, etp=1, sequence_parallel=True)
FAMILIES = {
    # leaf -> the leaf whose A it shares (fused into one Megatron linear: one A)
    "mixtral": (
        MIXTRAL,
        ["q_proj", "k_proj", "v_proj", "o_proj", "w1", "w3", "w2"],
        {"k_proj": "q_proj", "v_proj": "q_proj", "w3": "w1"},
    ),
    "deepseek_v3": (DEEPSEEK_V3, ["o_proj", "gate_proj", "up_proj", "down_proj"], {"up_proj": "gate_proj"}),
}
TRAINER_TARGETS = {"mixtral": None, "deepseek_v3": ["linear_proj", "linear_fc1", "linear_fc2"]}


def _config(family: str):
    return hf_config(FAMILIES[family][0], num_hidden_layers=2)  # DeepSeek-V3: a dense layer, then MoE


def _adapter_and_merged(hf_dir: Path, family: str, adapter_dir: Path, merged_dir: Path) -> None:
    """A random per-expert PEFT adapter on every target leaf of the checkpoint, and the checkpoint
    with that adapter merged in by hand."""
    from safetensors.torch import load_file, save_file

    _, leaves, shared_a = FAMILIES[family]
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


def _trainer_side(root: str, tokens: torch.Tensor) -> dict:
    """Rank function, one world for both families: per family, import base + adapter, logprobs,
    export the adapter and the merged model."""
    return {family: _family_side(family, f"{root}/{family}", tokens) for family in FAMILIES}


def _family_side(family: str, root: str, tokens: torch.Tensor):
    import torch.distributed as dist

    from moe_rl.config import TrainerConfig
    from moe_rl.trainer.megatron_trainer import MegatronTrainer
    from parallel.hf_checkpoint import load_hf_config
    from parallel.lora import TARGETS, LoRAConfig

    targets = TRAINER_TARGETS[family] or list(TARGETS)
    trainer = MegatronTrainer(
        TrainerConfig(**LAYOUT, micro_batch_size=2, global_batch_size=4),
        _config(family),
        lora=LoRAConfig(rank=RANK, alpha=ALPHA, target_modules=targets),
    )
    trainer.load_hf_weights(f"{root}/hf")
    trainer.load_adapter(f"{root}/adapter")
    logprobs = trainer.forward_logprobs({"tokens": tokens, "loss_mask": torch.ones_like(tokens)})
    trainer.save_adapter(f"{root}/out/adapter")
    trainer.save_hf_checkpoint(f"{root}/out/merged", load_hf_config(f"{root}/hf"))
    return logprobs.numpy().copy() if dist.get_rank() == 0 else None


def test_adapter_import_and_export_for_mixtral_and_deepseek_v3(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    tokens = torch.randint(0, 256, (4, 12), generator=torch.Generator().manual_seed(1))
    expected = {}
    for family in FAMILIES:
        hf_dir = save_random_model(_config(family), tmp_path / family / "hf")
        _adapter_and_merged(hf_dir, family, tmp_path / family / "adapter", tmp_path / family / "merged_reference")
        reference = AutoModelForCausalLM.from_pretrained(tmp_path / family / "merged_reference", dtype=torch.float32)
        with torch.no_grad():
            logits = reference.eval()(tokens).logits
        expected[family] = torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0]

    results = spawn(_trainer_side, 4, str(tmp_path), tokens)[0]
    for family, root in ((f, tmp_path / f) for f in FAMILIES):
        assert (torch.from_numpy(results[family]) - expected[family]).abs().max() < 1e-4, family
        original = load_file(str(root / "adapter" / "adapter_model.safetensors"))
        exported = load_file(str(root / "out" / "adapter" / "adapter_model.safetensors"))
        assert exported.keys() == original.keys(), family
        assert all(torch.equal(exported[k], original[k]) for k in original), family  # PEFT -> Megatron -> PEFT
        targets = json.loads((root / "out" / "adapter" / "adapter_config.json").read_text())["target_modules"]
        assert sorted(targets) == sorted(FAMILIES[family][1]), family  # what SGLang's --lora-target-modules takes
        merged = {
            k: v for f in sorted((root / "out" / "merged").glob("*.safetensors")) for k, v in load_file(f).items()
        }
        merged_reference = load_file(str(root / "merged_reference" / "model.safetensors"))
        assert merged.keys() == merged_reference.keys(), family
        assert max((merged[k] - merged_reference[k]).abs().max().item() for k in merged) < 1e-6, family
