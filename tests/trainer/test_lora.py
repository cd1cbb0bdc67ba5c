"""LoRA on the Megatron trainer, against PEFT as the ground truth.

A random PEFT adapter on every target of a tiny GLM-4.5 (GQA attention, a dense MLP layer,
shared and routed experts) is imported into the trainer under TP2+EP2+SP, PP2+EP2 and
TP2+EP2+ETP2: the trainer's logprobs equal those of PEFT's model (transformers + PeftModel, which
maps per-expert adapters onto transformers 5's fused experts), the adapter exports back bit for
bit, and the merged export equals PEFT's merge_and_unload.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from parallel.lora import TARGETS, LoRAConfig
from parallel.world import spawn
from tests.tiny_models import DEEPSEEK_V3, GLM4_MOE, hf_config, megatron_refusal

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

LAYOUTS = [
    dict(world_size=4, tp=2, ep=2, etp=1, sequence_parallel=True),
    dict(world_size=4, pp=2, ep=2),
    dict(world_size=4, tp=2, ep=2, etp=2, sequence_parallel=True),
]
RANK, ALPHA = 2, 3.0
SHARED_A = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}  # fused in Megatron: one A


def glm4_moe_config():
    """The shared tiny GLM-4.5 (tests/tiny_models.py) with 2 layers, 4 experts, a narrower dense MLP."""
    return hf_config(GLM4_MOE, intermediate_size=96, num_hidden_layers=2, n_routed_experts=4)


def save_tiny_model(out_dir: Path) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(glm4_moe_config(), dtype=torch.float32)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("e_score_correction_bias"):
                tensor.uniform_(-0.1, 0.1)
    model.save_pretrained(out_dir)
    return out_dir


def random_peft_adapter(hf_dir: Path, out_dir: Path, seed: int = 0) -> Path:
    """A random adapter on every q/k/v/o and gate/up/down projection of the checkpoint, in the
    per-expert PEFT format; fused Megatron targets share A, as a moe-rl adapter does."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    with safe_open(hf_dir / "model.safetensors", "pt") as f:
        names = sorted(
            n
            for n in f.keys()
            if n.split(".")[-2] in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
            and n.endswith(".weight")
        )
        shapes = {n: f.get_slice(n).get_shape() for n in names}
    for name in sorted(names, key=lambda n: n.split(".")[-2] in SHARED_A):  # owners of a shared A first
        out_features, in_features = shapes[name]
        module = name[: -len(".weight")]
        leaf = module.rsplit(".", 1)[1]
        if leaf in SHARED_A:
            a = tensors[f"base_model.model.{module.rsplit('.', 1)[0]}.{SHARED_A[leaf]}.lora_A.weight"].clone()
        else:
            a = torch.randn(RANK, in_features, generator=generator) / in_features**0.5
        tensors[f"base_model.model.{module}.lora_A.weight"] = a
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(out_features, RANK, generator=generator) * 0.3
    out_dir.mkdir(parents=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    (out_dir / "adapter_config.json").write_text(
        json.dumps(
            dict(
                peft_type="LORA",
                task_type="CAUSAL_LM",
                r=RANK,
                lora_alpha=ALPHA,
                lora_dropout=0.0,
                bias="none",
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            )
        )
    )
    return out_dir


def peft_model(hf_dir: Path, adapter_dir: Path):
    """PEFT's model with the adapter. PEFT 0.21 on transformers 5 moves every `gate_proj/up_proj/
    down_proj` target of an MoE model onto the fused experts and drops the dense-MLP and
    shared-expert ones, so those few are merged into the base first (W + alpha/r * B A)."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    adapter = load_file(str(adapter_dir / "adapter_model.safetensors"))
    modules = dict(base.named_modules())
    with torch.no_grad():
        for key, a in adapter.items():
            module = key[len("base_model.model.") : -len(".lora_A.weight")]
            if key.endswith(".lora_A.weight") and ".mlp." in module and ".experts." not in module:
                modules[module].weight += ALPHA / RANK * adapter[key.replace("lora_A", "lora_B")] @ a
    return PeftModel.from_pretrained(base, adapter_dir).eval()


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0]


def run_layouts(hf_dir: str, adapter_dir: str, out_dir: str, tokens: torch.Tensor) -> list:
    """Rank function: per layout, import base + adapter, logprobs, export adapter and merged."""
    import torch.distributed as dist

    from moe_rl.config import TrainerConfig
    from moe_rl.trainer.megatron_trainer import MegatronTrainer
    from parallel.hf_checkpoint import load_hf_config
    from parallel.lora import LoRAConfig

    hf_config = load_hf_config(hf_dir)
    out = []
    for i, layout in enumerate(LAYOUTS):
        trainer = MegatronTrainer(
            TrainerConfig(**layout, micro_batch_size=2, global_batch_size=4),
            glm4_moe_config(),
            lora=LoRAConfig(rank=RANK, alpha=ALPHA),
        )
        trainer.load_hf_weights(hf_dir)
        trainer.load_adapter(adapter_dir)
        logprobs = trainer.forward_logprobs({"tokens": tokens, "loss_mask": torch.ones_like(tokens)})
        trainer.save_adapter(f"{out_dir}/adapter{i}")
        trainer.save_hf_checkpoint(f"{out_dir}/merged{i}", hf_config)
        out.append(logprobs.numpy().copy() if dist.get_rank() == 0 else None)
    return out


def test_lora_matches_peft_under_every_layout(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    hf_dir = save_tiny_model(tmp_path / "hf")
    adapter_dir = random_peft_adapter(hf_dir, tmp_path / "adapter")
    tokens = torch.randint(0, 256, (4, 12), generator=torch.Generator().manual_seed(1))
    model = peft_model(hf_dir, adapter_dir)
    with torch.no_grad():
        expected = token_logprobs(model(tokens).logits, tokens)
        merged_reference = {k: v.clone() for k, v in model.merge_and_unload().state_dict().items()}

    results = spawn(run_layouts, 4, str(hf_dir), str(adapter_dir), str(tmp_path / "out"), tokens)[0]
    original = load_file(str(adapter_dir / "adapter_model.safetensors"))
    for i, layout in enumerate(LAYOUTS):
        logprobs = torch.from_numpy(results[i])
        assert (logprobs - expected).abs().max() < 1e-4, (layout, (logprobs - expected).abs().max())
        exported = load_file(str(tmp_path / "out" / f"adapter{i}" / "adapter_model.safetensors"))
        assert exported.keys() == original.keys(), layout
        assert all(torch.equal(exported[k], original[k]) for k in original), layout  # PEFT -> Megatron -> PEFT
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / f"merged{i}", dtype=torch.float32)
        state = merged.state_dict()
        assert state.keys() == merged_reference.keys()
        worst = max((state[k] - merged_reference[k]).abs().max().item() for k in state)
        assert worst < 1e-6, (layout, worst)


def train_and_resume(hf_dir: str, adapter_dir: str, out_dir: str, tokens: torch.Tensor, layout: dict) -> dict:
    """Rank function: one step's adapter gradients (gathered in PEFT naming), the base after two
    steps, the optimizer's parameters, and a resume from the step-1 checkpoint."""
    from moe_rl.config import OptimizerConfig, TrainerConfig
    from moe_rl.trainer.checkpoint import load_checkpoint, save_checkpoint
    from moe_rl.trainer.megatron_trainer import MegatronTrainer
    from parallel.export import model_tensors
    from parallel.lora import LoRAConfig, adapter_parameters
    from parallel.peft import export_adapter

    def build():
        config = TrainerConfig(
            **layout, micro_batch_size=2, global_batch_size=4, optimizer=OptimizerConfig(lr=1e-2, clip_grad=0.0)
        )
        trainer = MegatronTrainer(config, glm4_moe_config(), lora=LoRAConfig(rank=RANK, alpha=ALPHA))
        trainer.load_hf_weights(hf_dir)
        return trainer

    batch = {"tokens": tokens, "loss_mask": torch.ones_like(tokens)}
    trainer = build()
    trainer.load_adapter(adapter_dir)
    model = trainer.model.module
    base = {name: t.detach().clone() for name, t in model_tensors(model).items()}
    adapter = adapter_parameters(model)
    step = trainer.train_step(batch)
    weights = {name: p.detach().clone() for name, p in adapter.items()}
    with torch.no_grad():  # export the gradients through the adapter's own gather
        for name, p in adapter.items():
            p.copy_(p.main_grad)
    grads = {name: t.numpy().copy() for name, t in export_adapter(model, trainer.bridge)}
    with torch.no_grad():
        for name, p in adapter.items():
            p.copy_(weights[name])
    optimized = {
        id(p) for opt in trainer.optimizer.chained_optimizers for g in opt.optimizer.param_groups for p in g["params"]
    }
    save_checkpoint(trainer, f"{out_dir}/step1")
    trainer.train_step(batch)
    after = trainer.forward_logprobs(batch)
    unchanged = all(torch.equal(base[name], t) for name, t in model_tensors(model).items())

    resumed = build()
    load_checkpoint(resumed, f"{out_dir}/step1")
    resumed.train_step(batch)
    resumed_after = resumed.forward_logprobs(batch)
    return dict(
        grads=grads,
        grad_norm=step.grad_norm,
        base_unchanged=unchanged,
        only_adapters=optimized == {id(p) for p in adapter.values()},
        resumed_equal=bool(torch.equal(resumed_after, after)),
    )


# Gradients under TP/EP sum the same fp32 products in another order (and the CPU's kernels pick
# the order by its vector width), so they agree element-wise within this bound, not bit for bit.
ATOL, RTOL = 1e-6, 1e-4


def grad_norm_bound(grads: dict[str, np.ndarray]) -> float:
    """How far two gradient norms may differ when every element agrees within ATOL + RTOL * |g|:
    | ||p|| - ||g|| | <= ||p - g|| <= ATOL * sqrt(n) + RTOL * ||g|| (triangle inequality)."""
    flat = np.concatenate([g.ravel() for g in grads.values()]).astype(np.float64)
    return ATOL * flat.size**0.5 + RTOL * float(np.linalg.norm(flat))


@pytest.mark.parametrize("layout", [LAYOUTS[0], LAYOUTS[2]], ids=["tp2-ep2-sp", "tp2-ep2-etp2-sp"])
def test_lora_gradients_checkpoint_and_frozen_base(tmp_path, layout):
    """Adapter gradients under TP/EP/ETP/SP equal those on one rank; the base never changes; the
    optimizer holds only adapters; a checkpoint resumes exactly."""
    hf_dir = save_tiny_model(tmp_path / "hf")
    adapter_dir = random_peft_adapter(hf_dir, tmp_path / "adapter")
    tokens = torch.randint(0, 256, (4, 12), generator=torch.Generator().manual_seed(2))
    single = spawn(
        train_and_resume, 1, str(hf_dir), str(adapter_dir), str(tmp_path / "one"), tokens, dict(world_size=1)
    )[0]
    per_rank = spawn(train_and_resume, 4, str(hf_dir), str(adapter_dir), str(tmp_path / "four"), tokens, layout)
    for result in [single, *per_rank]:
        assert result["base_unchanged"] and result["only_adapters"] and result["resumed_equal"]
    parallel = per_rank[0]["grads"]
    assert parallel.keys() == single["grads"].keys() and len(parallel) > 0
    assert any(abs(g).max() > 0 for g in parallel.values())
    for name, grad in single["grads"].items():
        assert np.allclose(parallel[name], grad, atol=ATOL, rtol=RTOL), (name, abs(parallel[name] - grad).max())
    assert abs(per_rank[0]["grad_norm"] - single["grad_norm"]) <= grad_norm_bound(single["grads"])


def test_convert_peft_megatron_peft_is_bit_exact(tmp_path):
    """`moe-rl convert peft-to-megatron` at TP2+EP2, back with `megatron-to-peft` at PP2: the same file."""
    from safetensors.torch import load_file

    from moe_rl.cli import main

    hf_dir = save_tiny_model(tmp_path / "hf")
    adapter_dir = random_peft_adapter(hf_dir, tmp_path / "adapter")
    assert (
        main(
            [
                "convert",
                "peft-to-megatron",
                "--peft",
                str(adapter_dir),
                "--hf",
                str(hf_dir),
                "--out",
                str(tmp_path / "mcore"),
                "--tp",
                "2",
                "--ep",
                "2",
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "convert",
                "megatron-to-peft",
                "--megatron",
                str(tmp_path / "mcore"),
                "--out",
                str(tmp_path / "back"),
                "--pp",
                "2",
            ]
        )
        == 0
    )
    original = load_file(str(adapter_dir / "adapter_model.safetensors"))
    back = load_file(str(tmp_path / "back" / "adapter_model.safetensors"))
    assert back.keys() == original.keys() and all(torch.equal(back[k], original[k]) for k in original)
    config = json.loads((tmp_path / "back" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (RANK, ALPHA)


def count_adapter_parameters(config) -> tuple[int, int]:
    from moe_rl.config import TrainerConfig
    from moe_rl.trainer.megatron_trainer import MegatronTrainer
    from parallel.lora import adapter_parameters

    trainer = MegatronTrainer(TrainerConfig(world_size=1), config, lora=LoRAConfig(rank=RANK, alpha=ALPHA))
    params = adapter_parameters(trainer.model.module)
    expert = sum(p.numel() for name, p in params.items() if ".local_experts." in name)
    return sum(p.numel() for p in params.values()) - expert, expert


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3", "deepseek_v3_no_q_lora"])
def test_plan_counts_the_adapters_exactly(family):
    """`moe-rl plan`'s adapter count (attention, MLA's projections included, dense layers, shared and
    routed experts) is the trainer's, with every target the model has (the default)."""
    from moe_rl.plan.planner import count_parameters, lora_parameters

    config = {
        "glm4_moe": glm4_moe_config(),
        "deepseek_v3": hf_config(DEEPSEEK_V3, num_hidden_layers=2),
        "deepseek_v3_no_q_lora": hf_config(DEEPSEEK_V3, num_hidden_layers=2, q_lora_rank=None),
    }[family]
    if refusal := megatron_refusal(config):
        pytest.skip(f"refused on this megatron-core: {refusal}")
    assert (
        lora_parameters(config, count_parameters(config), RANK, list(TARGETS))
        == spawn(count_adapter_parameters, 1, config)[0]
    )
