"""`moe-rl convert`: HF -> Megatron torch_dist at layout A (TP2xEP2) -> HF at layout B
(PP2xEP2), through the real CLI and spawned gloo ranks, equals the original file bit for bit
and loads in transformers with identical logits (Qwen3-MoE and DeepSeek-V3)."""

from __future__ import annotations

import json

import pytest
import torch
from test_bridge_deepseek_v3 import deepseek_v3_config
from test_bridge_harness import save_tiny_hf_model
from test_bridge_qwen3_moe import qwen3_moe_config

from moe_rl.cli import main
from parallel.hf_checkpoint import HFCheckpointReader

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)


@pytest.mark.parametrize("make_config", [qwen3_moe_config, deepseek_v3_config], ids=["qwen3_moe", "deepseek_v3"])
def test_hf_megatron_hf_roundtrip_across_layouts(tmp_path, make_config):
    from transformers import AutoModelForCausalLM

    hf = save_tiny_hf_model(make_config(), tmp_path / "hf")
    megatron, back = tmp_path / "megatron", tmp_path / "hf_back"
    megatron.mkdir()
    (megatron / "old").write_text("an earlier conversion")  # replaced: --overwrite
    assert (
        main(
            [
                "convert",
                "hf-to-megatron",
                "--hf",
                str(hf),
                "--out",
                str(megatron),
                "--tp",
                "2",
                "--ep",
                "2",
                "--overwrite",
            ]
        )
        == 0
    )
    assert not (megatron / "old").exists()
    assert json.loads((megatron / "moe_rl_meta.json").read_text())["format"] == "torch_dist"
    assert not (tmp_path / "megatron.tmp").exists()
    assert (
        main(
            [
                "convert",
                "megatron-to-hf",
                "--megatron",
                str(megatron),
                "--out",
                str(back),
                "--pp",
                "2",
                "--ep",
                "2",
                "--etp",
                "1",
                "--max-shard-gb",
                str(40e3 / 2**30),
            ]
        )
        == 0
    )

    original, converted = HFCheckpointReader(hf), HFCheckpointReader(back)
    assert converted.names() == original.names()
    assert len(set(converted.weight_map.values())) > 2  # several shards + an index
    for name in original.names():
        assert torch.equal(converted.read(name), original.read(name)), name

    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(hf).eval()(tokens).logits
        actual = AutoModelForCausalLM.from_pretrained(back).eval()(tokens).logits
    assert torch.equal(actual, expected)


def test_bad_input_is_a_clear_error_before_launch(tmp_path, capsys):
    hf = save_tiny_hf_model(qwen3_moe_config(), tmp_path / "hf")
    assert main(["convert", "hf-to-megatron", "--hf", str(hf), "--out", str(tmp_path / "out"), "--ep", "3"]) == 2
    assert "ep=3 does not divide the model's 4 experts" in capsys.readouterr().err
    config = json.loads((hf / "config.json").read_text())
    config["architectures"] = ["MadeUpForCausalLM"]
    (hf / "config.json").write_text(json.dumps(config))
    assert main(["convert", "hf-to-megatron", "--hf", str(hf), "--out", str(tmp_path / "out")]) == 2
    assert "no bridge for architectures=['MadeUpForCausalLM']" in capsys.readouterr().err


def test_output_that_would_destroy_anything_is_refused(tmp_path, capsys):
    hf = save_tiny_hf_model(qwen3_moe_config(), tmp_path / "models" / "hf")
    before = sorted((p.name, p.stat().st_size) for p in hf.iterdir())
    used = tmp_path / "used"
    used.mkdir()
    (used / "keep.txt").write_text("a user's file")
    (tmp_path / "staged.tmp").mkdir()
    (tmp_path / "staged.tmp" / "x").write_text("")
    cases = [
        (hf, "would replace the input"),
        (tmp_path / "models", "would replace the input"),
        (used, "exists and is not empty"),
        (tmp_path / "staged", "exists and is not empty"),
    ]
    for out, message in cases:
        for direction, flag in (("hf-to-megatron", "--hf"), ("megatron-to-hf", "--megatron")):
            overwrite = ["--overwrite"] if "input" in message else []  # not even with --overwrite
            assert main(["convert", direction, flag, str(hf), "--out", str(out), *overwrite]) == 2
            assert message in capsys.readouterr().err, (out, direction)
    assert sorted((p.name, p.stat().st_size) for p in hf.iterdir()) == before
    assert (used / "keep.txt").read_text() == "a user's file"


class _RunsCode:
    """A pickle that calls os.system on load: what a crafted checkpoint would carry."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_a_crafted_checkpoint_is_refused_before_anything_unpickles_it(tmp_path, capsys):
    import pickle
    import shutil

    hf = save_tiny_hf_model(qwen3_moe_config(), tmp_path / "hf")
    megatron = tmp_path / "megatron"
    assert main(["convert", "hf-to-megatron", "--hf", str(hf), "--out", str(megatron)]) == 0
    from parallel.checkpoint_trust import check_dist_checkpoint

    check_dist_checkpoint(megatron)  # our own checkpoints pass
    crafted, marker = tmp_path / "crafted", tmp_path / "ran"
    shutil.copytree(megatron, crafted)
    (crafted / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    assert main(["convert", "megatron-to-hf", "--megatron", str(crafted), "--out", str(tmp_path / "out")]) == 2
    assert "refused (it references posix.system" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "out").exists()
