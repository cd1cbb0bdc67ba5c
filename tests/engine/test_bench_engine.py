"""`moe-rl bench engine`: the embedded engine's rows and transformers' generate() baseline, one run."""

from __future__ import annotations

import json
import re

import pytest

from moe_rl import cli

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)


def test_bench_engine_prints_generate_baseline_with_equal_tokens(capsys):
    args = ["bench", "engine", "--requests", "3", "--prompt-len", "5", "--max-new-tokens", "6", "--repeats", "2"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    tokens = {
        label: int(n) for label, n in re.findall(r"^  (serial|concurrent|generate\(\)) .* (\d+) tokens$", out, re.M)
    }
    assert tokens == {"serial": 18, "concurrent": 18, "generate()": 18}  # 3 requests x 6 new tokens each
    assert re.search(r"^  speedup +\d+\.\d+x", out, re.M)
    assert re.search(
        r"^  vs generate\(\) +\d+\.\d+x  concurrent vs transformers' generate\(\) at batch 3 \((cpu|cuda)\); "
        r"per repeat \d+\.\d+-\d+\.\d+x$",
        out,
        re.M,
    )


def test_bench_engine_json_pairs_every_concurrent_run_with_a_generate_run(capsys):
    assert (
        cli.main(
            [
                "bench",
                "engine",
                "--requests",
                "2",
                "--prompt-len",
                "4",
                "--max-new-tokens",
                "3",
                "--repeats",
                "2",
                "--json",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["concurrent_tokens"] == report["generate_tokens"] == 6
    assert (
        len(report["concurrent_all_s"]) == len(report["generate_all_s"]) == len(report["vs_generate_per_repeat"]) == 2
    )
    assert report["generate_device"] in ("cpu", "cuda")
