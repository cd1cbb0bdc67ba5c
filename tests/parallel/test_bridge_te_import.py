"""Import onto megatron-core's Transformer Engine spec, checked against an independent oracle.

Transformer Engine needs CUDA, so each rank installs the test fixture `tests/trainer/te_standin.py`
(a parameter-and-forward stand-in for TE's layer classes, see its docstring) before megatron-core
is imported: megatron-core 0.16.1's real TE-spec code (`get_gpt_decoder_block_spec(
use_transformer_engine=True)`, its TE wrappers, TEGroupedMLP) then builds the model tree here.

For every architecture, with grouped GEMM on (TEGroupedMLP, `experts.linear_fc1.weight{j}`) and
off (SequentialMLP of TE linears), under TP2 x EP2 (ETP2, sequence parallel), PP2 x EP2 (ETP1) and
EP2 x ETP2 (TP1), `load_hf_weights` fills the model (first set to NaN) and EVERY local tensor
(parameters and persistent buffers: all of the state dict but TE's empty `_extra_state`) must equal,
bit for bit, the slice `expected_tensor` computes from the HF safetensors by its own rules, written
from megatron-core's and TE's documented layouts. The oracle never calls the bridges' tables
(`bridge.mappings`, `parallel.mappings`), so an error made the same way on import and export (which
an import -> export round trip cannot catch) shows here. The HF tensors the ranks read together
must be all of the checkpoint's.

The rules (TP rank t of T, ETP rank u of U, EP rank r of R, E experts, PP stage s of P over L layers):
- layers: stage s holds global layers [s L/P, (s+1) L/P), numbered from 0 locally;
- vocab-parallel embedding / output layer: the HF rows zero-padded to a multiple of lcm(128, T), rows
  split in T contiguous parts;
- GQA `linear_qkv` (weight and bias): rows per query group g = [q heads g*h/G .. (g+1)*h/G - 1; k_g;
  v_g], rank t holding groups [t G/T, (t+1) G/T); its `layer_norm_weight` is the HF input norm;
- column-parallel linears: output rows split in T parts; row-parallel (`linear_proj`, `linear_fc2`):
  input columns split; gated `linear_fc1` = [gate rows of part t; up rows of part t], its fused
  `layer_norm_weight` the HF post-attention norm (dense layers; MoE layers keep
  `pre_mlp_layernorm`);
- routed experts: local expert j of EP rank r is global expert r E/R + j, split over ETP (U) as
  above, named `experts.linear_fc{1,2}.weight{j}` (grouped) or `experts.local_experts.{j}.
  linear_fc{1,2}.weight` (sequential); shared experts split over TP;
- MLA: the down projections (`linear_q_down_proj`, `linear_kv_down_proj`: TELinear, duplicated)
  are the full HF tensors; the up projections (TELayerNormColumnParallelLinear) are split by heads
  over TP and carry the latent norms (q_a_layernorm, kv_a_layernorm) as `layer_norm_weight`;
  without q LoRA, `linear_q_proj` (TEColumnParallelLinear) is HF q_proj split by heads;
- MLA rotary rows (the last qk_rope_head_dim rows of each head of q, and of kv_a_proj_with_mqa):
  megatron-core de-interleaves (x0, x2, ..., x1, x3, ...) before rotating halves, as HF does for
  `rope_interleave: true`; an HF checkpoint with `rope_interleave: false` rotates halves directly,
  so its rotary rows [a; b] (halves) must sit interleaved: a0, b0, a1, b1, ...
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest
import torch

from parallel.world import spawn
from tests.tiny_models import megatron_refusal

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

LAYOUTS = [
    dict(world_size=4, tp=2, ep=2, sequence_parallel=True),  # experts ETP2
    dict(world_size=4, pp=2, ep=2, etp=1),
    dict(world_size=4, ep=2, etp=2),
]  # dense TP1, experts ETP2
ARCHS = ["qwen3_moe", "glm4_moe", "mixtral", "deepseek_v3", "deepseek_v3_not_interleaved", "deepseek_v3_no_q_lora"]
VOCAB_DIVISOR = 128  # the bridges pad the vocab to a multiple of lcm(128, TP), the same for TP in 1, 2, 4, 8


def hf_configs() -> dict:
    from test_bridge_deepseek_v3 import deepseek_v3_config
    from test_bridge_mixtral_glm import glm4_moe_config, mixtral_config
    from test_bridge_qwen3_moe import qwen3_moe_config

    return {
        "qwen3_moe": qwen3_moe_config(),
        "glm4_moe": glm4_moe_config(),
        "mixtral": mixtral_config(),
        "deepseek_v3": deepseek_v3_config(),
        "deepseek_v3_not_interleaved": deepseek_v3_config(rope_interleave=False),
        "deepseek_v3_no_q_lora": deepseek_v3_config(q_lora_rank=None, rope_interleave=False),
    }


# -- the oracle ----------------------------------------------------------------------------------
class Oracle:
    """Expected local tensors of one rank, from the HF tensors and the rank's place (no bridge)."""

    def __init__(self, hf: dict[str, torch.Tensor], config: dict, ranks: dict):
        self.hf, self.config, self.used = hf, config, set()
        self.tp, self.tp_size = ranks["tp"], ranks["tp_size"]
        self.etp, self.etp_size = ranks["etp"], ranks["etp_size"]
        self.ep, self.ep_size = ranks["ep"], ranks["ep_size"]
        layers = config["num_hidden_layers"]
        self.layer_offset = ranks["pp"] * layers // ranks["pp_size"]
        experts = config.get("n_routed_experts") or config.get("num_experts") or config.get("num_local_experts")
        self.local_experts = experts // self.ep_size
        self.mixtral = config["architectures"] == ["MixtralForCausalLM"]

    def read(self, name: str) -> torch.Tensor:
        self.used.add(name)
        return self.hf[name]

    # slicing helpers: part `rank` of `size` along `dim`
    @staticmethod
    def part(t: torch.Tensor, rank: int, size: int, dim: int = 0) -> torch.Tensor:
        return t.chunk(size, dim=dim)[rank]

    def gated(self, gate: str, up: str, rank: int, size: int) -> torch.Tensor:
        return torch.cat([self.part(self.read(gate), rank, size), self.part(self.read(up), rank, size)])

    def vocab(self, name: str, local_rows: int) -> torch.Tensor:
        full = self.read(name)
        padded = local_rows * self.tp_size
        assert padded % VOCAB_DIVISOR == 0 and 0 <= padded - full.shape[0] < VOCAB_DIVISOR * self.tp_size
        full = torch.cat([full, full.new_zeros(padded - full.shape[0], *full.shape[1:])])
        return self.part(full, self.tp, self.tp_size)

    def qkv(self, prefix: str, suffix: str) -> torch.Tensor:
        q, k, v = (self.read(f"{prefix}.{p}_proj.{suffix}") for p in "qkv")
        groups = self.config["num_key_value_heads"]
        rest = q.shape[1:]
        per_group = torch.cat(
            [q.reshape(groups, -1, *rest), k.reshape(groups, -1, *rest), v.reshape(groups, -1, *rest)], dim=1
        )
        return self.part(per_group, self.tp, self.tp_size).reshape(-1, *rest)

    def rope_rows(self, t: torch.Tensor, block: int) -> torch.Tensor:
        """Blocks of `block` rows, each ending in the rotary rows, in megatron-core's interleaved order."""
        if self.config.get("rope_interleave", True):
            return t
        rope = self.config["qk_rope_head_dim"]
        blocks = t.reshape(-1, block, t.shape[-1])
        first, second = blocks[:, block - rope : block - rope // 2], blocks[:, block - rope // 2 :]
        interleaved = torch.stack([first, second], dim=2).reshape(blocks.shape[0], rope, -1)
        return torch.cat([blocks[:, : block - rope], interleaved], dim=1).reshape(t.shape)

    def expected(self, name: str, local_shape: torch.Size) -> torch.Tensor:
        if name == "embedding.word_embeddings.weight":
            return self.vocab("model.embed_tokens.weight", local_shape[0])
        if name == "output_layer.weight":
            tied = self.config.get("tie_word_embeddings", False)
            return self.vocab("model.embed_tokens.weight" if tied else "lm_head.weight", local_shape[0])
        if name == "decoder.final_layernorm.weight":
            return self.read("model.norm.weight")
        found = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
        if not found:
            raise KeyError(name)
        layer, rest = int(found[1]) + self.layer_offset, found[2]
        hf = f"model.layers.{layer}"
        attn, mlp = f"{hf}.self_attn", f"{hf}.block_sparse_moe" if self.mixtral else f"{hf}.mlp"
        heads = self.config["num_attention_heads"]
        simple = {
            "input_layernorm.weight": f"{hf}.input_layernorm.weight",
            "self_attention.linear_qkv.layer_norm_weight": f"{hf}.input_layernorm.weight",
            "self_attention.q_layernorm.weight": f"{attn}.q_norm.weight",
            "self_attention.k_layernorm.weight": f"{attn}.k_norm.weight",
            "self_attention.linear_q_down_proj.weight": f"{attn}.q_a_proj.weight",
            "self_attention.linear_q_up_proj.layer_norm_weight": f"{attn}.q_a_layernorm.weight",
            "self_attention.linear_kv_up_proj.layer_norm_weight": f"{attn}.kv_a_layernorm.weight",
            "pre_mlp_layernorm.weight": f"{hf}.post_attention_layernorm.weight",
            "mlp.linear_fc1.layer_norm_weight": f"{hf}.post_attention_layernorm.weight",
            "mlp.router.weight": f"{mlp}.gate.weight",
            "mlp.router.expert_bias": f"{mlp}.gate.e_score_correction_bias",
        }
        if rest in simple:
            return self.read(simple[rest])
        if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            return self.qkv(attn, rest.rsplit(".", 1)[1])
        if rest == "self_attention.linear_proj.weight":
            return self.part(self.read(f"{attn}.o_proj.weight"), self.tp, self.tp_size, dim=1)
        q_block = self.config.get("qk_nope_head_dim", 0) + self.config.get("qk_rope_head_dim", 0)
        if rest in ("self_attention.linear_q_up_proj.weight", "self_attention.linear_q_proj.weight"):
            hf_name = f"{attn}.q_b_proj.weight" if "up_proj" in rest else f"{attn}.q_proj.weight"
            full = self.rope_rows(self.read(hf_name), q_block)
            assert full.shape[0] == heads * q_block
            return self.part(full, self.tp, self.tp_size)  # by heads
        if rest == "self_attention.linear_kv_down_proj.weight":
            full = self.read(f"{attn}.kv_a_proj_with_mqa.weight")  # [kv latent; shared rotary rows]
            return self.rope_rows(full, full.shape[0])
        if rest == "self_attention.linear_kv_up_proj.weight":
            full = self.read(f"{attn}.kv_b_proj.weight")  # per head [k_nope; v]
            return self.part(full, self.tp, self.tp_size)
        if rest == "mlp.linear_fc1.weight":
            return self.gated(f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight", self.tp, self.tp_size)
        if rest == "mlp.linear_fc2.weight":
            return self.part(self.read(f"{mlp}.down_proj.weight"), self.tp, self.tp_size, dim=1)
        if rest == "mlp.shared_experts.linear_fc1.weight":
            shared = f"{mlp}.shared_experts"
            return self.gated(f"{shared}.gate_proj.weight", f"{shared}.up_proj.weight", self.tp, self.tp_size)
        if rest == "mlp.shared_experts.linear_fc2.weight":
            return self.part(self.read(f"{mlp}.shared_experts.down_proj.weight"), self.tp, self.tp_size, dim=1)
        found = re.fullmatch(r"mlp\.experts\.linear_fc([12])\.weight(\d+)", rest) or re.fullmatch(
            r"mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight", rest
        )
        if found:
            fc, j = (found[1], found[2]) if "local_experts" not in rest else (found[2], found[1])
            expert = f"{mlp}.experts.{self.ep * self.local_experts + int(j)}"
            gate, up, down = ("w1", "w3", "w2") if self.mixtral else ("gate_proj", "up_proj", "down_proj")
            if fc == "1":
                return self.gated(f"{expert}.{gate}.weight", f"{expert}.{up}.weight", self.etp, self.etp_size)
            return self.part(self.read(f"{expert}.{down}.weight"), self.etp, self.etp_size, dim=1)
        raise KeyError(name)


# -- the rank function ---------------------------------------------------------------------------
def import_and_compare(hf_dirs: dict[str, str], layouts: list[dict]) -> list[dict]:
    """Rank function: the TE stand-in installed, per layout, architecture and expert kind, build
    the TE-spec model, set it to NaN, import, and compare each local tensor with the oracle."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "trainer"))
    import te_standin

    te_standin.install()
    from megatron.core import parallel_state as ps
    from safetensors.torch import load_file

    from parallel.bridges import bridge_for
    from parallel.hf_import import load_hf_weights
    from parallel.layout import ParallelLayout
    from parallel.model import build_gpt_model, init_model_parallel

    out = []
    for layout_kwargs in layouts:
        layout = ParallelLayout(**layout_kwargs)
        init_model_parallel(layout, seed=0)
        ranks = dict(
            tp=ps.get_tensor_model_parallel_rank(),
            tp_size=ps.get_tensor_model_parallel_world_size(),
            etp=ps.get_expert_tensor_parallel_rank(),
            etp_size=ps.get_expert_tensor_parallel_world_size(),
            ep=ps.get_expert_model_parallel_rank(),
            ep_size=ps.get_expert_model_parallel_world_size(),
            pp=ps.get_pipeline_model_parallel_rank(),
            pp_size=ps.get_pipeline_model_parallel_world_size(),
        )
        for arch, hf_dir in hf_dirs.items():
            config = json.loads((Path(hf_dir) / "config.json").read_text())
            hf = load_file(str(Path(hf_dir) / "model.safetensors"))
            for grouped in (True, False):
                started = time.perf_counter()
                bridge = bridge_for(config)
                model = build_gpt_model(bridge, layout, use_te=True, moe_grouped_gemm=grouped)
                state = model.state_dict(keep_vars=True)
                tensors = {k: v for k, v in state.items() if not k.endswith("._extra_state")}
                extra = {k: v for k, v in state.items() if k.endswith("._extra_state")}
                with torch.no_grad():
                    for t in tensors.values():
                        t.fill_(float("nan"))
                load_hf_weights(model, bridge, hf_dir)
                oracle = Oracle(hf, config, ranks)
                mismatches, checked = [], set()
                for name, t in tensors.items():
                    try:
                        want = oracle.expected(name, t.shape)
                    except KeyError:
                        mismatches.append((name, "no rule in the oracle"))
                        continue
                    checked.add(name)
                    got = t.detach().cpu()
                    if not torch.equal(got, want):
                        worst = (
                            (got - want).abs().max().item()
                            if got.shape == want.shape
                            else f"shape {tuple(t.shape)} != {tuple(want.shape)}"
                        )
                        mismatches.append((name, worst))
                modules = {type(m).__name__ for m in model.modules()}
                out.append(
                    dict(
                        arch=arch,
                        layout=layout_kwargs,
                        grouped=grouped,
                        rank=torch.distributed.get_rank(),
                        checked=checked,
                        parameters={n for n, _ in model.named_parameters()},
                        tensors=set(tensors),
                        mismatches=mismatches,
                        used=oracle.used,
                        hf=set(hf),
                        extra_state_sizes={t.numel() if isinstance(t, torch.Tensor) else None for t in extra.values()},
                        modules=modules,
                        seconds=time.perf_counter() - started,
                    )
                )
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """One 4-rank world for every architecture, layout and expert kind: {arch: [result per rank and case]}."""
    from test_bridge_harness import save_tiny_hf_model

    root = tmp_path_factory.mktemp("te_import")
    configs = hf_configs()
    refused = {arch: why for arch, config in configs.items() if (why := megatron_refusal(config))}
    hf_dirs = {arch: str(save_tiny_hf_model(c, root / arch)) for arch, c in configs.items() if arch not in refused}
    per_rank = spawn(import_and_compare, 4, hf_dirs, LAYOUTS, fresh=True)
    by_arch: dict = {arch: refused.get(arch, []) for arch in ARCHS}  # a refused arch: the refusal
    for rank_results in per_rank:
        for result in rank_results:
            by_arch[result["arch"]].append(result)
    return by_arch


@pytest.mark.parametrize("arch", ARCHS)
def test_te_import_equals_independent_slices(results, arch):
    """Every local tensor of the TE-spec model after import equals the oracle's slice, bit for
    bit, on every rank, layout and expert kind; every tensor is checked; all HF tensors are read."""
    cases = results[arch]
    if isinstance(cases, str):
        pytest.skip(f"refused on this megatron-core: {cases}")
    assert len(cases) == 4 * len(LAYOUTS) * 2
    for case in cases:
        where = (arch, case["layout"], "grouped" if case["grouped"] else "sequential", f"rank {case['rank']}")
        assert not case["mismatches"], (where, case["mismatches"])
        assert case["checked"] == case["tensors"] and case["parameters"] <= case["tensors"], where
        assert case["extra_state_sizes"] <= {0, None}, where  # `_extra_state`: TE's empty (no FP8) or none
        modules = case["modules"]
        assert "TERowParallelLinear" in modules and "TELayerNormColumnParallelLinear" in modules, where
        if case["grouped"]:
            assert "TEGroupedMLP" in modules and "SequentialMLP" not in modules, where
            assert any(re.search(r"\.experts\.linear_fc1\.weight\d+$", n) for n in case["tensors"]), where
        else:
            assert "SequentialMLP" in modules and "TEGroupedMLP" not in modules, where
            assert "TEColumnParallelLinear" in modules, where  # the sequential experts' fc1
        if arch.startswith("deepseek_v3"):
            assert "TELinear" in modules, where  # MLA's duplicated down projection(s)
    for layout in LAYOUTS:
        for grouped in (True, False):
            group = [c for c in cases if c["layout"] == layout and c["grouped"] == grouped]
            assert set().union(*(c["used"] for c in group)) == group[0]["hf"], (arch, layout, grouped)
