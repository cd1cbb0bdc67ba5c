"""`moe-rl bench engine`: the embedded engine's rows and transformers' generate() baseline, one run."""

from __future__ import annotations

import re

from moe_rl import cli


def test_bench_engine_prints_generate_baseline_with_equal_tokens(capsys):
    assert cli.main(["bench", "engine", "--requests", "3", "--prompt-len", "5", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    tokens = {label: int(n) for label, n in re.findall(r"^  (serial|concurrent|generate\(\)) .* (\d+) tokens$", out, re.M)}
    assert tokens == {"serial": 18, "concurrent": 18, "generate()": 18}  # 3 requests x 6 new tokens each
    assert re.search(r"^  speedup +\d+\.\d+x", out, re.M)
    assert re.search(r"^  vs generate\(\) +\d+\.\d+x  concurrent vs transformers' generate\(\) at batch 3", out, re.M)
