"""`moe-rl eval CONFIG --checkpoint DIR`: a saved HF checkpoint and its Megatron conversion (`moe-rl
convert hf-to-megatron`) are evaluated alone, with no Ray; greedy sampling makes the two agree
sample for sample (the conversion round-trips the weights exactly)."""

from __future__ import annotations

import json

import pytest
import yaml

from moe_rl import cli
from moe_rl.rollout.dump import SampleDump

pytestmark = pytest.mark.world  # starts engines and a conversion rank (tests/conftest.py)


def test_eval_of_an_hf_checkpoint_and_of_its_megatron_conversion(qwen3_dir, tmp_path, capsys):
    config = {
        "model": {"path": str(qwen3_dir)},
        "eval": {
            "datasets": [
                {"name": "heldout", "task": "copy_digits", "task_options": {"length": 2, "split": "eval"},
                 "num_prompts": 6, "n_samples_per_prompt": 2, "temperature": 0.0, "max_new_tokens": 3}
            ]
        },
    }  # fmt: skip
    path = tmp_path / "eval.yaml"
    path.write_text(yaml.safe_dump(config))
    converted = tmp_path / "converted"
    assert cli.main(["convert", "hf-to-megatron", "--hf", str(qwen3_dir), "--out", str(converted)]) == 0

    results = {}
    for name, checkpoint in (("hf", qwen3_dir), ("megatron", converted)):
        out = tmp_path / f"eval_{name}"
        assert cli.main(["eval", str(path), "--checkpoint", str(checkpoint), "--output", str(out), "--step", "7"]) == 0
        (row,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert row["step"] == 7
        for key in ("reward_mean", "pass@1", "pass@2", "mean@2", "truncation_rate", "seconds"):
            assert f"eval/heldout/{key}" in row
        records = SampleDump(out / "eval" / "heldout").read(7)
        assert len(records) == 12 and {v for r in records for _, _, v in r["versions"]} == {7}
        results[name] = [(r["prompt_ids"], r["response_ids"], r["reward"]) for r in records]
    assert (converted.parent / "eval_megatron" / "hf" / "config.json").is_file()  # converted for the engine
    assert results["hf"] == results["megatron"]
    assert "eval/heldout/pass@1" in capsys.readouterr().out  # the printed table
