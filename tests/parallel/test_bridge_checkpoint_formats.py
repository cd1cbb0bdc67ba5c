"""Checkpoints as users download them, not as save_pretrained writes them:
- DeepSeek-V3 with block-scaled FP8 weights (float8_e4m3fn + `weight_scale_inv`,
  `quantization_config`) and one multi-token-prediction layer, imported under TP2+EP2+SP and
  PP2+EP2 into megatron-core's MTP block: logits equal transformers' own dequantized model (its
  FP8 loader on CPU) and the export, MTP layer included, equals the dequantized tensors; with
  `model.mtp: drop` the MTP tensors are left out (warned);
- the convert CLI round trip of that checkpoint, to full precision and back to FP8 blocks;
- FP8 blocks that do not divide the shape (DeepSeek's 576-row kv_a_proj_with_mqa), read in slices;
- GLM-4.5 with fused experts (`mlp.experts.gate_up_proj` / `down_proj`), `rotary_emb.inv_freq`
  and one MTP layer.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_bridge_deepseek_v3 import deepseek_v3_config
from test_bridge_harness import BATCH, SEQ, assert_layout_results, check_layouts, hf_reference, save_tiny_hf_model

from moe_rl.cli import main
from parallel.fp8 import BlockFP8
from parallel.hf_checkpoint import HFCheckpointReader
from parallel.layout import ParallelLayout
from parallel.world import spawn
from tests.tiny_models import GLM4_MOE, hf_config, with_mtp_layer

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

LAYOUTS = [
    ParallelLayout(world_size=4, tp=2, ep=2, sequence_parallel=True),
    ParallelLayout(world_size=4, pp=2, ep=2, etp=1),
]
BLOCK = BlockFP8(8, 8)  # DeepSeek's is 128 x 128; 8 divides every tiny shape, as transformers' FP8 loader needs


def _tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def _write(out: Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))
    return out


def save_deepseek_fp8_with_mtp(tmp_path: Path) -> tuple[Path, set[str]]:
    """A tiny DeepSeek-V3 laid out as DeepSeek ships it: every projection in FP8 blocks with its
    scale_inv, `quantization_config`, and one MTP layer. Returns (dir, the MTP tensor names)."""
    base = save_tiny_hf_model(deepseek_v3_config(), tmp_path / "bf16")
    config = json.loads((base / "config.json").read_text())
    mtp = config["num_hidden_layers"]
    stored = {}
    for name, tensor in with_mtp_layer(_tensors(base), config).items():
        linear = tensor.ndim == 2 and not name.endswith(
            (".gate.weight", "embed_tokens.weight", "shared_head.head.weight")
        )
        if name.startswith("model.layers.") and linear:
            stored[name], stored[name + "_scale_inv"] = BLOCK.quantize(tensor)
        else:
            stored[name] = tensor
    config.update(
        num_nextn_predict_layers=1,
        quantization_config={
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [BLOCK.rows, BLOCK.cols],
        },
    )
    mtp_names = {n for n in stored if n.startswith(f"model.layers.{mtp}.") and not n.endswith("_scale_inv")}
    return _write(tmp_path / "fp8", stored, config), mtp_names


def test_deepseek_v3_fp8_with_mtp_imports_under_tp_ep_pp(tmp_path):
    hf_dir, mtp_names = save_deepseek_fp8_with_mtp(tmp_path)
    reader = HFCheckpointReader(hf_dir)
    assert reader.read("model.layers.0.self_attn.q_a_proj.weight").dtype == torch.float32  # dequantized
    assert not [n for n in reader.names() if n.endswith("_scale_inv")]
    tokens = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    reference = hf_reference(hf_dir, tokens)  # transformers dequantizes FP8 checkpoints on CPU
    per_rank = spawn(check_layouts, 4, str(hf_dir), LAYOUTS, tokens, 4096)
    assert_layout_results(per_rank, hf_dir, reference, tokens)  # the MTP layer's tensors too, bit for bit


def test_deepseek_v3_with_mtp_dropped(tmp_path):
    from moe_rl.config import load_config

    hf_dir, mtp_names = save_deepseek_fp8_with_mtp(tmp_path)
    warned = spawn(_import_warnings, 1, str(hf_dir))[0]
    assert any(
        re.search(rf"model.mtp=drop: {len(mtp_names)} tensors .* model.layers.4.\* are not imported", w) for w in warned
    ), warned
    assert not [w for w in warned if "differs from" in w]  # the MTP copies of embedding and head are the model's
    tokens = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    per_rank = spawn(check_layouts, 4, str(hf_dir), LAYOUTS[1:], tokens, 4096, True)
    assert_layout_results(per_rank, hf_dir, hf_reference(hf_dir, tokens), tokens, left_out=mtp_names)
    run = tmp_path / "run.yaml"
    run.write_text(f"model:\n  path: {hf_dir}\ntrainer:\n  micro_batch_size: 1\n  global_batch_size: 1\n")
    assert load_config(str(run)).model.load_hf_config().num_nextn_predict_layers == 1
    assert load_config(str(run), ["model.mtp=drop"]).model.load_hf_config().num_nextn_predict_layers == 0


def _import_warnings(hf_dir: str) -> list[str]:
    """Rank function: one-rank import of the MTP checkpoint; the warnings it gave."""
    import warnings

    from parallel.bridges import bridge_for, without_mtp
    from parallel.hf_import import load_hf_weights
    from parallel.model import build_gpt_model, init_model_parallel

    bridge = bridge_for(without_mtp(json.loads((Path(hf_dir) / "config.json").read_text())))
    layout = ParallelLayout(world_size=1)
    init_model_parallel(layout, seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_hf_weights(build_gpt_model(bridge, layout), bridge, hf_dir)
    return [str(w.message) for w in caught]


def test_convert_round_trips_fp8_and_mtp(tmp_path):
    """FP8 + MTP -> Megatron (MTP block) -> HF twice. Full precision: tensors, the MTP layer's
    included, equal to the dequantized ones, a config with its MTP layer and without quantization.
    --fp8-blocks: the original FP8 bytes and scales back bit for bit, DeepSeek's
    quantization_config. Both give transformers the original's logits."""
    from transformers import AutoModelForCausalLM

    hf_dir, mtp_names = save_deepseek_fp8_with_mtp(tmp_path)
    mcore, full, fp8 = tmp_path / "mcore", tmp_path / "full", tmp_path / "fp8_again"
    assert main(["convert", "hf-to-megatron", "--hf", str(hf_dir), "--out", str(mcore), "--ep", "2"]) == 0
    assert main(["convert", "megatron-to-hf", "--megatron", str(mcore), "--out", str(full), "--ep", "2"]) == 0
    assert (
        main(
            [
                "convert",
                "megatron-to-hf",
                "--megatron",
                str(mcore),
                "--out",
                str(fp8),
                "--pp",
                "2",
                "--fp8-blocks",
                str(BLOCK.rows),
            ]
        )
        == 0
    )
    original = HFCheckpointReader(hf_dir)
    config = json.loads((full / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and "quantization_config" not in config
    exported = HFCheckpointReader(full)
    assert exported.names() == original.names() and mtp_names <= exported.names()
    for name in exported.names():
        assert torch.equal(exported.read(name), original.read(name)), name
    config = json.loads((fp8 / "config.json").read_text())
    assert config["quantization_config"] == json.loads((hf_dir / "config.json").read_text())["quantization_config"]
    stored, again = _tensors(hf_dir), _tensors(fp8)
    assert set(again) == set(stored)
    for name, tensor in again.items():
        assert tensor.dtype == stored[name].dtype and torch.equal(
            tensor.view(torch.uint8), stored[name].view(torch.uint8)
        ), name
    tokens = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    reference = hf_reference(hf_dir, tokens)
    for out in (full, fp8):
        with torch.no_grad():
            logits = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(tokens).logits
        assert torch.equal(logits, reference), out


def test_fp8_round_trip_through_bf16_keeps_the_bytes_and_bounds_the_scales():
    weight = torch.randn(300, 260, generator=torch.Generator().manual_seed(0)) * 0.02
    block = BlockFP8(128, 128)
    quantized, scale_inv = block.quantize(weight)
    again, scale_again = block.quantize(block.dequantize(quantized, scale_inv).to(torch.bfloat16))
    assert torch.equal(again.view(torch.uint8), quantized.view(torch.uint8))
    assert ((scale_again - scale_inv).abs() / scale_inv).max() <= 2**-9


def test_fp8_blocks_that_do_not_divide_the_shape_read_in_slices(tmp_path):
    block = BlockFP8(16, 16)
    weight = torch.randn(37, 50, generator=torch.Generator().manual_seed(0))
    quantized, scale_inv = block.quantize(weight)
    assert scale_inv.shape == (3, 4)
    expected = torch.empty(37, 50)
    for i in range(3):  # block by block, as written in DeepSeek's model card
        for j in range(4):
            rows, cols = slice(16 * i, 16 * (i + 1)), slice(16 * j, 16 * (j + 1))
            expected[rows, cols] = quantized[rows, cols].float() * scale_inv[i, j]
    assert (expected - weight).abs().max() <= weight.abs().max() / 16  # e4m3: 3 mantissa bits
    config = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16]}}
    reader = HFCheckpointReader(
        _write(tmp_path / "ckpt", {"w.weight": quantized, "w.weight_scale_inv": scale_inv}, config)
    )
    assert reader.names() == {"w.weight"} and reader.shape("w.weight") == (37, 50)
    assert torch.equal(reader.read("w.weight"), expected)
    assert torch.equal(reader.read("w.weight", 0, 5, 30), expected[5:30])
    assert torch.equal(reader.read("w.weight", 1, 17, 50), expected[:, 17:])
    bad = {"quantization_config": {"quant_method": "gptq", "bits": 4}}
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="quant_method='gptq'.*dequantize the checkpoint first"):
        HFCheckpointReader(tmp_path / "ckpt")


def test_glm4_moe_with_fused_experts_inv_freq_and_mtp(tmp_path):
    """GLM-4.5 with its experts fused (the MTP layer's too) imports, and exports per expert."""
    hf_dir = save_tiny_hf_model(hf_config(GLM4_MOE, num_nextn_predict_layers=1), tmp_path / "per_expert")
    config = json.loads((hf_dir / "config.json").read_text())
    tensors = with_mtp_layer(_tensors(hf_dir), config)
    hf_dir = _write(tmp_path / "per_expert_mtp", tensors, config)
    fused = {n: t for n, t in tensors.items() if ".mlp.experts." not in n}
    for layer in range(config["first_k_dense_replace"], config["num_hidden_layers"] + 1):
        p = f"model.layers.{layer}.mlp.experts"
        experts = range(config["n_routed_experts"])
        fused[f"{p}.gate_up_proj"] = torch.stack(
            [torch.cat([tensors[f"{p}.{e}.gate_proj.weight"], tensors[f"{p}.{e}.up_proj.weight"]]) for e in experts]
        )
        fused[f"{p}.down_proj"] = torch.stack([tensors[f"{p}.{e}.down_proj.weight"] for e in experts])
        fused[f"model.layers.{layer}.self_attn.rotary_emb.inv_freq"] = torch.rand(8)
    fused_dir = _write(tmp_path / "fused", fused, config)
    reader = HFCheckpointReader(fused_dir)
    assert reader.names() == HFCheckpointReader(hf_dir).names()  # per-expert names, inv_freq left out
    assert torch.equal(
        reader.read("model.layers.1.mlp.experts.5.up_proj.weight", 0, 8, 24),
        tensors["model.layers.1.mlp.experts.5.up_proj.weight"][8:24],
    )
    tokens = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    per_rank = spawn(check_layouts, 4, str(fused_dir), LAYOUTS, tokens, 4096)
    assert_layout_results(per_rank, fused_dir, hf_reference(hf_dir, tokens), tokens)


def test_mtp_declared_but_not_saved_builds_as_stored(tmp_path):
    """transformers' DeepSeek-V3 config counts one MTP layer that its save_pretrained never writes
    (fine-tunes saved that way): the model is built, imported and exported as stored, without it."""
    from moe_rl.config import load_config
    from parallel.hf_checkpoint import declares_absent_mtp

    hf_dir = save_tiny_hf_model(deepseek_v3_config(num_nextn_predict_layers=1), tmp_path / "hf")
    assert json.loads((hf_dir / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert declares_absent_mtp(hf_dir) and not HFCheckpointReader(hf_dir).mtp_names()
    run = tmp_path / "run.yaml"
    run.write_text(f"model:\n  path: {hf_dir}\ntrainer:\n  micro_batch_size: 1\n  global_batch_size: 1\n")
    assert load_config(str(run)).model.load_hf_config().num_nextn_predict_layers == 0
    tokens = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    per_rank = spawn(check_layouts, 2, str(hf_dir), [ParallelLayout(world_size=2, pp=2)], tokens, 4096)
    assert_layout_results(per_rank, hf_dir, hf_reference(hf_dir, tokens), tokens)
