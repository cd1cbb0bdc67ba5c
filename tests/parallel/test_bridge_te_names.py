"""Transformer Engine spec names in the bridge tables.

Transformer Engine cannot be installed on a CPU machine, so the CPU tests check the tables
against the parameter names the TE spec produces, written out below from megatron-core
0.16.1's `get_gpt_layer_with_transformer_engine_spec` (TESpecProvider): GQA layers fuse the
input norm into `linear_qkv` (TELayerNormColumnParallelLinear: `weight`, `layer_norm_weight`,
`bias`), dense MLPs fuse the pre-MLP norm into `linear_fc1`, MoE layers keep `pre_mlp_layernorm`
(TENorm), grouped experts are TEGroupedMLP (`linear_fc1.weight{j}` per local expert), MLA keeps
`input_layernorm`, has duplicated TELinear down projections and fuses the latent norms into
the up projections. For each name: a mapping exists, it reads the same TP/EP shard as the
local-spec parameter it replaces (or the full tensor, for duplicated TELinear), and the TE
names cover every HF tensor. The gpu-marked test builds a real TE model and round-trips it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_bridge_deepseek_v3 import deepseek_v3_config
from test_bridge_harness import save_tiny_hf_model
from test_bridge_mixtral_glm import glm4_moe_config
from test_bridge_qwen3_moe import qwen3_moe_config

from parallel.bridges import bridge_for
from parallel.hf_checkpoint import HFCheckpointReader
from parallel.mappings import Axis, ParallelContext, Replicated, resolve
from parallel.world import spawn

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

TP, EP = 2, 2


def te_layer_names(
    layer: int,
    *,
    moe: bool,
    experts_per_rank: int,
    mla: bool,
    qk_norm: bool,
    qkv_bias: bool,
    shared: bool,
    expert_bias: bool,
) -> dict[str, str | None]:
    """{TE name: the local-spec name holding the same shard, or None if TE holds the full tensor}."""
    p = f"decoder.layers.{layer}"
    a = f"{p}.self_attention"
    if mla:
        names = {
            f"{p}.input_layernorm.weight": f"{p}.input_layernorm.weight",
            f"{a}.linear_q_down_proj.weight": None,
            f"{a}.linear_kv_down_proj.weight": None,
            f"{a}.linear_q_up_proj.layer_norm_weight": f"{a}.q_layernorm.weight",
            f"{a}.linear_kv_up_proj.layer_norm_weight": f"{a}.kv_layernorm.weight",
        }
        names.update({f"{a}.{n}.weight": f"{a}.{n}.weight" for n in ("linear_q_up_proj", "linear_kv_up_proj")})
    else:
        names = {
            f"{a}.linear_qkv.weight": f"{a}.linear_qkv.weight",
            f"{a}.linear_qkv.layer_norm_weight": f"{p}.input_layernorm.weight",
        }
        if qkv_bias:
            names[f"{a}.linear_qkv.bias"] = f"{a}.linear_qkv.bias"
        if qk_norm:
            names.update({f"{a}.{n}.weight": f"{a}.{n}.weight" for n in ("q_layernorm", "k_layernorm")})
    names[f"{a}.linear_proj.weight"] = f"{a}.linear_proj.weight"
    m = f"{p}.mlp"
    if not moe:
        names[f"{m}.linear_fc1.layer_norm_weight"] = f"{p}.pre_mlp_layernorm.weight"
        names.update({f"{m}.linear_fc{i}.weight": f"{m}.linear_fc{i}.weight" for i in (1, 2)})
        return names
    names[f"{p}.pre_mlp_layernorm.weight"] = f"{p}.pre_mlp_layernorm.weight"
    names[f"{m}.router.weight"] = f"{m}.router.weight"
    if expert_bias:
        names[f"{m}.router.expert_bias"] = f"{m}.router.expert_bias"
    for j in range(experts_per_rank):
        names.update(
            {
                f"{m}.experts.linear_fc{i}.weight{j}": f"{m}.experts.local_experts.{j}.linear_fc{i}.weight"
                for i in (1, 2)
            }
        )
    if shared:
        names.update(
            {f"{m}.shared_experts.linear_fc{i}.weight": f"{m}.shared_experts.linear_fc{i}.weight" for i in (1, 2)}
        )
    return names


def te_model_names(hf_config, experts_per_rank: int) -> dict[str, str | None]:
    bridge = bridge_for(hf_config)
    config = bridge.transformer_config_kwargs()
    pattern = config.get("moe_layer_freq") or [1] * config["num_layers"]
    names = {
        n: n for n in ("embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight")
    }
    for layer, moe in enumerate(pattern):
        names.update(
            te_layer_names(
                layer,
                moe=bool(moe),
                experts_per_rank=experts_per_rank,
                mla=config.get("multi_latent_attention", False),
                qk_norm=config.get("qk_layernorm", False),
                qkv_bias=config.get("add_qkv_bias", False),
                shared=bool(config.get("moe_shared_expert_intermediate_size")),
                expert_bias=bool(config.get("moe_router_enable_expert_bias")),
            )
        )
    return names


def context(tp_rank: int, ep_rank: int, bridge) -> ParallelContext:
    tp = Axis(None, tp_rank, TP)
    return ParallelContext(
        tp=tp,
        etp=tp,
        ep=Axis(None, ep_rank, EP),
        pp_rank=0,
        pp_size=1,
        layer_offset=0,
        num_local_experts=bridge.num_experts // EP,
        vocab_size=bridge.vocab_size,
    )


@pytest.mark.parametrize(
    "make_config", [qwen3_moe_config, glm4_moe_config, deepseek_v3_config], ids=["qwen3_moe", "glm4_moe", "deepseek_v3"]
)
def test_te_names_map_to_the_same_shards_as_the_local_spec(tmp_path, make_config):
    hf_config = make_config()
    hf_dir = save_tiny_hf_model(hf_config, tmp_path / "hf")
    reader = HFCheckpointReader(hf_dir)
    bridge = bridge_for(json.loads((Path(hf_dir) / "config.json").read_text()))
    local_table, te_table = bridge.mappings(te=False), bridge.mappings(te=True)
    names = te_model_names(hf_config, bridge.num_experts // EP)
    covered: set[str] = set()
    for tp_rank in range(TP):
        for ep_rank in range(EP):
            ctx = context(tp_rank, ep_rank, bridge)
            for te_name, local_name in names.items():
                mapping, indices = resolve(te_table, te_name)
                full_shape = torch.Size(reader.shape(mapping.hf_names(ctx, indices)[0]))
                if local_name is None:  # duplicated TELinear: every rank holds the full tensor
                    assert isinstance(mapping, Replicated) or not mapping.split, te_name
                    shard = mapping.read_shard(reader, mapping.hf_names(ctx, indices), mapping.axis(ctx), full_shape)
                    local, local_indices = resolve(local_table, te_name)
                    gathered = torch.cat(
                        [
                            local.read_shard(reader, local.hf_names(ctx, local_indices), Axis(None, r, TP), None)
                            for r in range(TP)
                        ]
                    )
                    assert torch.equal(shard, gathered), te_name
                else:
                    local, local_indices = resolve(local_table, local_name)
                    names_te, names_local = mapping.hf_names(ctx, indices), local.hf_names(ctx, local_indices)
                    assert names_te == names_local, (te_name, local_name)
                    assert mapping.expert == local.expert, te_name
                    if te_name != local_name or type(mapping) is not type(local):
                        expected = local.read_shard(reader, names_local, local.axis(ctx), None)
                        got = mapping.read_shard(reader, names_te, mapping.axis(ctx), None)
                        assert torch.equal(got, expected), te_name
                if mapping.exported:
                    covered.update(mapping.hf_names(ctx, indices))
    assert covered == reader.names()


def te_roundtrip(hf_dir: str) -> list[str]:
    """Rank function: build the TE-spec model, import, export; returns mismatched HF names."""
    from parallel.context import uses_transformer_engine
    from parallel.export import export_hf_weights
    from parallel.hf_import import load_hf_weights
    from parallel.layout import ParallelLayout
    from parallel.model import build_gpt_model, init_model_parallel

    layout = ParallelLayout(world_size=1)
    init_model_parallel(layout, seed=0)
    bridge = bridge_for(json.loads((Path(hf_dir) / "config.json").read_text()))
    model = build_gpt_model(bridge, layout, moe_grouped_gemm=True)
    assert uses_transformer_engine(model)
    load_hf_weights(model, bridge, hf_dir)
    reader = HFCheckpointReader(hf_dir)
    exported = dict(export_hf_weights(model, bridge))
    assert set(exported) == reader.names()
    return [n for n, t in exported.items() if not torch.equal(t.cpu(), reader.read(n))]


@pytest.mark.gpu_te
@pytest.mark.parametrize(
    "make_config", [qwen3_moe_config, glm4_moe_config, deepseek_v3_config], ids=["qwen3_moe", "glm4_moe", "deepseek_v3"]
)
def test_te_spec_model_roundtrip(tmp_path, make_config):
    pytest.importorskip("transformer_engine")
    hf_dir = save_tiny_hf_model(make_config(), tmp_path / "hf")
    assert spawn(te_roundtrip, 1, str(hf_dir)) == [[]]
