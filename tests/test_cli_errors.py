"""Bad input at the CLI: one line naming the input and the fix, exit status 2, no traceback."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_rl import cli
from moe_rl.rl.resume import truncate_rows


def error_of(capsys, argv: list[str]) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("moe-rl: error: ") and "Traceback" not in err and err.count("\n") == 1, err
    return err


def test_yaml_syntax_error_names_the_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  hf_config: [1, 2\ntrainer: {}\n")
    err = error_of(capsys, ["train", str(bad)])
    assert "bad.yaml" in err and "not valid YAML at line" in err
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    assert "must hold a mapping" in error_of(capsys, ["train", str(tmp_path / "list.yaml")])


def test_convert_with_a_zero_size_is_refused(qwen3_dir, tmp_path, capsys):
    for flag in ("--tp", "--ep", "--pp"):
        err = error_of(
            capsys, ["convert", "hf-to-megatron", "--hf", str(qwen3_dir), "--out", str(tmp_path / "o"), flag, "0"]
        )
        assert f"{flag}=0: must be a positive integer" in err


def test_serve_refuses_a_dense_a_truncated_or_a_nan_checkpoint(qwen3_dir, tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    dense = tmp_path / "dense"
    LlamaForCausalLM(
        LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=64,
        )
    ).save_pretrained(dense)
    capsys.readouterr()  # save_pretrained's progress bar
    assert "is not a Mixture-of-Experts model" in error_of(capsys, ["serve", str(dense), "--port", "0"])

    truncated = tmp_path / "truncated"
    shutil.copytree(qwen3_dir, truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert "is truncated" in error_of(capsys, ["serve", str(truncated), "--port", "0"])

    nan = tmp_path / "nan"
    shutil.copytree(qwen3_dir, nan)
    state = load_file(nan / "model.safetensors")
    name = sorted(state)[0]
    state[name] = torch.full_like(state[name], float("nan"))
    save_file(state, nan / "model.safetensors", metadata={"format": "pt"})
    err = error_of(capsys, ["serve", str(nan), "--port", "0"])
    assert name in err and "NaN or infinite" in err


def test_resume_on_an_hf_directory_says_what_it_is(qwen3_dir, capsys):
    assert "is an HF model directory, not a moe-rl run directory" in error_of(
        capsys, ["train", "--resume", str(qwen3_dir)]
    )


def test_a_torn_last_metrics_line_is_dropped_and_a_bad_one_named(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"ste')  # the crash tore the last row
    truncate_rows(metrics, last_step=2)
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2]
    metrics.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl: line 2 is not a metrics row"):
        truncate_rows(metrics, last_step=2)
