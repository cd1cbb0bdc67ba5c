"""LoRA on megatron-core's Transformer Engine spec, on CPU through the TE stand-in (te_standin).

The TE-spec models: a tiny Qwen3-MoE (layer 0 dense, layer 1 MoE) and the tiny GLM-4.5 of
test_lora (dense layer, shared experts, q/k/v bias), with grouped experts (TEGroupedMLP) and with
SequentialMLP of TE linears. They exercise every adapted TE linear: TELayerNormColumnParallelLinear
(linear_qkv, dense linear_fc1: the adapter reads the normed input), TERowParallelLinear,
TEColumnParallelLinear (shared and sequential experts) and the grouped linears (one adapter per
expert). PEFT on the transformers model is the oracle, as
in test_lora, whose helpers these tests reuse. Each rank installs the stand-in before megatron-core
is imported (`under_te`); TE's own tensor-parallel communication runs in the stand-in on gloo.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from test_lora import (
    ALPHA,
    ATOL,
    RANK,
    RTOL,
    grad_norm_bound,
    peft_model,
    random_peft_adapter,
    save_tiny_model,
    token_logprobs,
    train_and_resume,
)

from parallel.world import spawn

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

LAYOUTS = [
    dict(world_size=2, ep=2),
    dict(world_size=2, tp=2, sequence_parallel=True),  # experts ETP2: the dispatcher does their TP
    dict(world_size=2, tp=2, etp=1, sequence_parallel=True),
]
SEED = 7
GROUPED_NAME = r"\.experts\.linear_fc[12]\.weight[0-3]$"  # TEGroupedMLP: weight{j} of local expert j
SEQUENTIAL_NAME = r"\.experts\.local_experts\.[0-3]\.linear_fc[12]\.weight$"


def qwen3_moe_config():
    from tiny_qwen3 import TINY_QWEN3_MOE
    from transformers import AutoConfig

    fields = {k: v for k, v in TINY_QWEN3_MOE.items() if k != "model_type"}
    return AutoConfig.for_model("qwen3_moe", **{**fields, "num_hidden_layers": 2, "mlp_only_layers": [0]})


def save_qwen3_moe(out_dir: Path) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(qwen3_moe_config(), dtype=torch.float32).save_pretrained(out_dir)
    return out_dir


MODELS = {"qwen3_moe": save_qwen3_moe, "glm4_moe": save_tiny_model}


def under_te(fn, *args):
    """Rank function: `fn(*args)` with the TE stand-in installed, the trainer building the TE spec
    with grouped experts (TE needs CUDA, so the trainer would pick the local spec here)."""
    import te_standin

    te_standin.install()
    from moe_rl.trainer import megatron_trainer
    from parallel.model import build_gpt_model

    def build_te(bridge, layout, use_te=None, **overrides):
        return build_gpt_model(bridge, layout, use_te=True, moe_grouped_gemm=True, **overrides)

    megatron_trainer.build_gpt_model = build_te
    return fn(*args)


def _build(hf_dir: str, layout, te: bool, grouped: bool = False):
    from parallel.bridges import bridge_for
    from parallel.hf_checkpoint import load_hf_config
    from parallel.hf_import import load_hf_weights
    from parallel.lora import LoRAConfig, add_lora
    from parallel.model import build_gpt_model

    bridge = bridge_for(load_hf_config(hf_dir))
    model = build_gpt_model(bridge, layout, use_te=te, moe_grouped_gemm=grouped)
    load_hf_weights(model, bridge, hf_dir)
    add_lora(model, bridge, LoRAConfig(rank=RANK, alpha=ALPHA), SEED)
    return bridge, model.eval()


def _checkpoint_layout(model) -> dict:
    """{(checkpoint key, global offset): (global shape, local shape, replica id)} of this rank's
    adapter-only sharded state dict (gated fc1's factories built into their gate and up halves)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    from parallel.lora import adapter_sharded_state_dict

    layout = {}
    for entry in adapter_sharded_state_dict(model).values():
        for t in nested_values(entry.build()) if isinstance(entry, ShardedTensorFactory) else [entry]:
            layout[t.key, tuple(t.global_offset)] = (tuple(t.global_shape), tuple(t.local_shape), t.replica_id)
    return layout


def te_layouts(hf_dir: str, adapter_dir: str, tokens: torch.Tensor, layouts: list[dict]) -> list:
    """Rank function (under the stand-in, or with the real TE on a GPU): per layout and expert
    kind, the TE-spec model's fresh adapter, its adapter checkpoint layout next to the local
    spec's, and with the PEFT adapter loaded its logprobs, gradients and export."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    from parallel.context import uses_transformer_engine
    from parallel.layout import ParallelLayout
    from parallel.lora import adapter_parameters, adapters
    from parallel.model import init_model_parallel
    from parallel.peft import export_adapter, load_adapter

    def collect(model, bridge) -> dict:
        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, {k: v.detach().cpu().clone() for k, v in export_adapter(model, bridge)})
        return {k: v for part in parts for k, v in part.items()}

    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    tokens = tokens.to(device)
    out = []
    for layout in layouts:
        layout = ParallelLayout(**layout)
        init_model_parallel(layout, seed=0)
        _, local = _build(hf_dir, layout, te=False)
        for grouped in (True, False):  # TEGroupedMLP, or SequentialMLP of TE linears
            bridge, model = _build(hf_dir, layout, te=True, grouped=grouped)
            assert uses_transformer_engine(model) and not uses_transformer_engine(local)
            fresh = collect(model, bridge)
            load_adapter(model, bridge, adapter_dir)
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
            logits = mappings.gather_from_tensor_model_parallel_region(model(tokens, positions, attention_mask=None))
            logprobs = token_logprobs(logits[..., : bridge.vocab_size], tokens)
            logprobs.sum().backward()
            trained = adapter_parameters(model)
            gradients = dict(
                base=[n for n, p in model.named_parameters() if n not in trained and p.grad is not None],
                missing=[n for n, p in trained.items() if p.grad is None],
                zero=[n for n, p in trained.items() if p.grad is not None and not p.grad.abs().max() > 0],
                count=len(trained),
                experts=sum(".experts." in n for n in trained),
            )
            out.append(
                dict(
                    layout=layout,
                    grouped=grouped,
                    fresh=fresh,
                    exported=collect(model, bridge),
                    expert_adapters=[n for n in adapters(model) if ".experts." in n],
                    gradients=gradients,
                    checkpoint=(_checkpoint_layout(model), _checkpoint_layout(local)),
                    logprobs=logprobs.detach().cpu(),
                )
            )
    return out


def local_fresh_adapter(hf_dir: str) -> dict:
    """Rank function (no stand-in): the fresh adapter of the local-spec model on one rank."""
    from parallel.layout import ParallelLayout
    from parallel.model import init_model_parallel
    from parallel.peft import export_adapter

    layout = ParallelLayout(world_size=1)
    init_model_parallel(layout, seed=0)
    bridge, model = _build(hf_dir, layout, te=False)
    return {k: v.detach().cpu().clone() for k, v in export_adapter(model, bridge)}


@pytest.mark.parametrize("model_name", list(MODELS))
def test_te_lora_matches_peft_and_the_local_spec(tmp_path, model_name):
    """Grouped and sequential TE experts under EP2, TP2+SP (ETP2) and TP2+SP (ETP1): PEFT's logprobs,
    PEFT -> TE -> PEFT bit for bit, a fresh TE-spec adapter equal bit for bit to the local spec's,
    the local spec's adapter checkpoint keys and shards, gradients for the adapters and none for the base."""
    from safetensors.torch import load_file

    hf_dir = MODELS[model_name](tmp_path / "hf")
    adapter_dir = random_peft_adapter(hf_dir, tmp_path / "adapter")
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = token_logprobs(peft_model(hf_dir, adapter_dir)(tokens).logits, tokens)
    original = load_file(str(adapter_dir / "adapter_model.safetensors"))
    local_fresh = spawn(local_fresh_adapter, 1, str(hf_dir))[0]

    results = spawn(under_te, 2, te_layouts, str(hf_dir), str(adapter_dir), tokens, LAYOUTS, fresh=True)[0]
    assert len(results) == 2 * len(LAYOUTS)
    check_te_results(results, expected, original, local_fresh)


def check_te_results(results: list, expected: torch.Tensor, original: dict, local_fresh: dict) -> None:
    for result in results:
        case = (result["layout"], "grouped" if result["grouped"] else "sequential")
        experts = result["expert_adapters"]  # one adapter per local expert, named by its weight
        pattern = GROUPED_NAME if result["grouped"] else SEQUENTIAL_NAME
        assert experts and all(re.search(pattern, name) for name in experts), (case, experts)
        gradients = result["gradients"]  # the base gets no gradient, every adapter one
        assert not gradients["base"] and not gradients["missing"] and gradients["count"] > 0, (case, gradients)
        # a zero gradient only where no token was routed: some routed expert, never all of them
        assert all(".experts." in name for name in gradients["zero"]), (case, gradients["zero"])
        assert len(gradients["zero"]) < gradients["experts"], (case, gradients["zero"])
        worst = (result["logprobs"] - expected).abs().max().item()
        assert worst < 1e-4, (case, worst)
        exported = result["exported"]
        assert exported.keys() == original.keys(), case
        assert all(torch.equal(exported[k], original[k]) for k in original), case
        assert result["fresh"].keys() == local_fresh.keys(), case
        assert all(torch.equal(result["fresh"][k], local_fresh[k]) for k in local_fresh), case
        te_checkpoint, local_checkpoint = result["checkpoint"]
        assert te_checkpoint == local_checkpoint and te_checkpoint, case


@pytest.mark.gpu_te
def test_te_lora_matches_peft_with_the_real_transformer_engine(tmp_path):
    """The same checks with the real Transformer Engine on one GPU: what the stand-in stands for."""
    pytest.importorskip("transformer_engine")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from safetensors.torch import load_file

    hf_dir = save_qwen3_moe(tmp_path / "hf")
    adapter_dir = random_peft_adapter(hf_dir, tmp_path / "adapter")
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = token_logprobs(peft_model(hf_dir, adapter_dir)(tokens).logits, tokens)
    local_fresh = spawn(local_fresh_adapter, 1, str(hf_dir))[0]
    results = spawn(te_layouts, 1, str(hf_dir), str(adapter_dir), tokens, [dict(world_size=1)])[0]
    check_te_results(results, expected, load_file(str(adapter_dir / "adapter_model.safetensors")), local_fresh)


def test_te_lora_gradients_equal_one_rank(tmp_path):
    """GLM-4.5 on the TE spec, EP2 and TP2+SP vs one rank: equal adapter gradients and grad norm;
    the base never changes; the optimizer holds only adapters; the adapter checkpoint resumes."""
    hf_dir = save_tiny_model(tmp_path / "hf")
    adapter_dir = random_peft_adapter(hf_dir, tmp_path / "adapter")
    tokens = torch.randint(0, 256, (4, 12), generator=torch.Generator().manual_seed(2))
    args = (str(hf_dir), str(adapter_dir))
    single = spawn(under_te, 1, train_and_resume, *args, str(tmp_path / "one"), tokens, dict(world_size=1), fresh=True)[
        0
    ]
    for i, layout in enumerate([dict(world_size=2, ep=2), dict(world_size=2, tp=2, sequence_parallel=True)]):
        per_rank = spawn(under_te, 2, train_and_resume, *args, str(tmp_path / f"two{i}"), tokens, layout, fresh=True)
        for result in [single, *per_rank]:
            assert result["base_unchanged"] and result["only_adapters"] and result["resumed_equal"], layout
        parallel = per_rank[0]["grads"]
        assert parallel.keys() == single["grads"].keys() and any(".experts.3." in name for name in parallel)
        assert any(abs(g).max() > 0 for g in parallel.values())
        for name, grad in single["grads"].items():
            worst = abs(parallel[name] - grad).max()
            assert np.allclose(parallel[name], grad, atol=ATOL, rtol=RTOL), (layout, name, worst)
        assert abs(per_rank[0]["grad_norm"] - single["grad_norm"]) <= grad_norm_bound(single["grads"]), layout
