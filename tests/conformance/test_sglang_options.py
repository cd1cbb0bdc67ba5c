"""`engines.sglang` against SGLang 0.5.23's own code (conformance tier).

- The shipped table (`moe_rl/engine/sglang_options.json`) is what SGLang's parser declares
  (`ServerArgs.add_cli_args`), and every option of it, written in `engines.sglang` and turned into
  argv by `option_args`, is parsed by that parser to the value written.
- The cross-field rules refuse what SGLang's own resolution code rejects or silently changes
  (`_a2a_ep_size`, `handle_eplb_and_dispatch`), and the plan's KV bytes per `kv_cache_dtype` are
  the element sizes SGLang's `configure_kv_cache_dtype` picks.
- `moe-rl plan` (a subprocess, as a user runs it) prints launch commands SGLang parses with the
  options and `--max-running-requests` from `engines.max_batch`, and refuses a mistyped option
  with the name SGLang knows.
"""

from __future__ import annotations

import difflib
import shlex
import subprocess
import sys
from types import SimpleNamespace

import pytest

from moe_rl.config import load_config
from moe_rl.engine.sglang_options import (
    KV_CACHE_BYTES,
    OWNED,
    SPECULATIVE,
    check_options,
    option_args,
    read_parser,
    table,
)
from tests.conformance import sglang_oracle

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

RECIPE = "configs/recipes/qwen3_30b_a3b_math_grpo.yaml"
SAMPLES = {"int": 7, "float": 0.25, "str": "x", "loads": {"a": 1}, "json_list_type": ["a", "b"], "nullable_str": "x"}
"""A value of each type; `human_readable_int` takes an int too (its "4K" strings are SGLang's business)."""


def _sglang_parse(argv: list[str]) -> dict:
    """SGLang's parse of `argv`: unknown arguments, the namespace, and the error argparse exits with."""
    import argparse
    import contextlib
    import io

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            namespace, unknown = parser.parse_known_args(argv)
    except SystemExit:
        return {"error": stderr.getvalue()}
    return {"unknown": unknown, "namespace": {k: v for k, v in vars(namespace).items() if _plain(v)}}


def _plain(value) -> bool:
    return value is None or isinstance(value, (bool, int, float, str, list, dict))


def _sample(entry: dict):
    if entry["kind"] in ("flag", "bool"):
        return not entry.get("default", False)
    if entry.get("choices"):
        return entry["choices"][-1]
    return SAMPLES.get(entry["type"], 4096 if entry["type"] == "human_readable_int" else None)


def _samples() -> tuple[dict, dict]:
    """Every option moe-rl passes through (not owned, not speculative, not deprecated) with a value
    of its type: (engines.sglang, {dest: the value SGLang must parse})."""
    options, expected = {}, {}
    for name, entry in table()["options"].items():
        if name in OWNED or name.startswith(SPECULATIVE) or entry["kind"] == "deprecated":
            continue
        value = _sample(entry)
        if value is None:  # a parser of its own (cuda_graph_config): SGLang's format, not a type
            continue
        options[name] = [value] if entry["kind"] == "list" else value
        expected[entry["dest"]] = options[name]
    return options, expected


def _ask_sglang(questions: dict) -> dict:
    return {
        "table": read_parser(),
        "samples": _sglang_parse(questions["samples"]),
        "a2a": _a2a_ep_sizes(questions["backends"]),
        "eplb": _eplb_outcomes(questions["eplb"]),
        "kv": _kv_element_bytes(questions["kv"]),
        "nearest": _nearest_flag(questions["flag"]),
    }


@pytest.fixture(scope="module")
def sglang() -> dict:
    """SGLang's code on the questions of the tests below, asked in one oracle process (each costs
    an import of SGLang, torch and transformers)."""
    questions = {
        "samples": ["--model-path", "/m", *option_args(_samples()[0])],
        "backends": table()["options"]["moe_a2a_backend"]["choices"],
        "eplb": [_eplb_record(options, ep) for options, ep in EPLB_CASES],
        "kv": sorted(KV_CACHE_BYTES),
        "flag": "--moe-a2a-backnd",
    }
    return sglang_oracle.call(_ask_sglang, questions)


def test_the_table_is_sglangs_parser(sglang):
    assert sglang["table"] == table()


def test_every_option_is_parsed_by_sglang_as_written(sglang):
    """All of them in one `engines.sglang`: accepted by `check_options`, and SGLang's parser reads
    each back as written."""
    options, expected = _samples()
    assert len(options) > 400
    check_options(options, tp=2, ep=2)
    parsed = sglang["samples"]
    assert "error" not in parsed, parsed.get("error")
    assert parsed["unknown"] == []
    got = {dest: parsed["namespace"].get(dest) for dest in expected}
    assert got == expected


def _a2a_ep_sizes(backends: list[str]) -> dict:
    from sglang.srt.arg_groups.overrides import _a2a_ep_size

    return {b: _a2a_ep_size(SimpleNamespace(moe_a2a_backend=b, tp_size=8, ep_size=2)) for b in backends}


def test_a2a_backends_that_reset_ep_size_are_refused_unless_ep_is_tp(sglang):
    for backend, ep_size in sglang["a2a"].items():
        resets = ep_size == {"ep_size": 8}
        assert resets or ep_size == {}, (backend, ep_size)
        check_options({"moe_a2a_backend": backend}, tp=8, ep=8)
        if resets:
            with pytest.raises(ValueError, match=f"moe_a2a_backend={backend} .* set engines.ep=8"):
                check_options({"moe_a2a_backend": backend}, tp=8, ep=2)
        else:
            check_options({"moe_a2a_backend": backend}, tp=8, ep=2)


def _eplb_outcomes(cases: list[dict]) -> list[str]:
    """SGLang's `handle_eplb_and_dispatch` on each case: "ok" or the exception's type. Its resolution
    views are stood in for by the record itself (the values are already the resolved ones)."""
    import logging

    from sglang.srt.arg_groups import parallel_hook

    def declare(record, _who, **values):
        vars(record).update(values)

    namespace = {
        **vars(parallel_hook),
        "resolving_view": lambda s: s,
        "resolved_view": lambda s: s,
        "declare_resolution": declare,
        "logger": logging.getLogger("eplb"),
    }
    handle = sglang_oracle.extract("sglang.srt.arg_groups.parallel_hook", "handle_eplb_and_dispatch", namespace)
    outcomes = []
    for case in cases:
        record = SimpleNamespace(
            **{"expert_distribution_recorder_mode": None, "init_expert_location": "trivial", **case}
        )
        try:
            handle(record)
            outcomes.append("ok")
        except (AssertionError, ValueError) as error:
            outcomes.append(type(error).__name__)
    return outcomes


EPLB_CASES = [  # (engines.sglang, engines.ep)
    ({"enable_eplb": True}, 1),
    ({"enable_eplb": True}, 2),
    ({"enable_eplb": True, "elastic_ep_join_mode": "scale"}, 1),
    ({"enable_eplb": True, "moe_a2a_backend": "deepep"}, 2),
    ({"ep_dispatch_algorithm": "static"}, 2),
    ({"ep_dispatch_algorithm": "lp"}, 2),
    ({"ep_dispatch_algorithm": "dynamic"}, 2),
    ({"ep_dispatch_algorithm": "static", "moe_a2a_backend": "deepep"}, 2),
]


def _eplb_record(options: dict, ep: int) -> dict:
    """The server-args fields `handle_eplb_and_dispatch` reads, as these options and engines.ep set them."""
    return {
        "enable_eplb": options.get("enable_eplb", False),
        "ep_join_mode": options.get("elastic_ep_join_mode"),
        "ep_dispatch_algorithm": options.get("ep_dispatch_algorithm"),
        "moe_a2a_backend": options.get("moe_a2a_backend", "none"),
        "ep_size": ep,
    }


def test_eplb_and_dispatch_rules_match_sglang(sglang):
    assert sglang["eplb"] == ["AssertionError", "ok", "ok", "ok", "ValueError", "ValueError", "ok", "ok"]
    for (options, ep), outcome in zip(EPLB_CASES, sglang["eplb"]):
        if outcome == "ok":
            check_options(options, tp=ep, ep=ep)
        else:
            with pytest.raises(ValueError, match="engines.sglang.e"):
                check_options(options, tp=ep, ep=ep)


def _kv_element_bytes(dtypes: list[str]) -> dict:
    """Bytes per cached value of the torch dtype SGLang's `configure_kv_cache_dtype` picks (CUDA, not ROCm)."""
    import torch

    namespace = {
        "torch": torch,
        "Optional": None,
        "nn": torch.nn,
        "_is_hip": False,
        "fp8_dtype": torch.float8_e4m3fn,
        "current_platform": SimpleNamespace(is_cpu=lambda: False),
        "TORCH_DTYPE_TO_KV_CACHE_STR": {},
        "logger": __import__("logging").getLogger("kv"),
    }
    configure = sglang_oracle.extract("sglang.srt.mem_cache.kv_cache_dtype", "configure_kv_cache_dtype", namespace)
    out = {}
    for dtype in dtypes:
        _, picked = configure(
            server_args_kv_cache_dtype=dtype,
            model=None,
            model_dtype=torch.bfloat16,
            is_draft_worker=False,
            is_dflash=False,
            speculative_draft_attention_backend=None,
        )
        out[dtype] = picked.itemsize / (2 if picked == getattr(torch, "float4_e2m1fn_x2", None) else 1)
    return out


def test_kv_bytes_per_dtype_are_sglangs_element_sizes(sglang):
    choices = table()["options"]["kv_cache_dtype"]["choices"]
    assert set(KV_CACHE_BYTES) == set(choices) - {"auto"}  # a new choice needs its bytes here
    for dtype, element in sglang["kv"].items():
        scale = KV_CACHE_BYTES[dtype] - element  # block formats add a one-byte scale per 16 or 32 values
        assert scale in (0, 1 / 16, 1 / 32), (dtype, element, KV_CACHE_BYTES[dtype])


def _plan(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moe_rl.cli", "plan", RECIPE, *overrides], capture_output=True, text=True, timeout=300
    )


LAUNCH_CHECKED = (
    "moe_a2a_backend",
    "kv_cache_dtype",
    "max_running_requests",
    "tp_size",
    "ep_size",
    "mem_fraction_static",
)


def _parse_launches(argvs: list[list[str]]) -> list[dict]:
    from sglang.srt.server_args import ServerArgs

    out = []
    for argv in argvs:
        parsed = _sglang_parse(argv)
        args = ServerArgs.from_cli_args(SimpleNamespace(**parsed["namespace"]))
        out.append({"unknown": parsed["unknown"], **{k: getattr(args, k) for k in LAUNCH_CHECKED}})
    return out


def test_plan_prints_launch_commands_sglang_parses_with_the_options():
    done = _plan("engines.sglang.moe_a2a_backend=deepep", "engines.sglang.kv_cache_dtype=fp8_e4m3")
    assert done.returncode == 0, done.stderr
    engines = load_config(RECIPE).engines
    lines = [
        line.strip() for line in done.stdout.splitlines() if line.strip().startswith("engine ") and "sglang" in line
    ]
    assert len(lines) == engines.count
    argvs = []
    for line in lines:
        words = shlex.split(line.split(": ", 1)[1])
        assert words[:4] == ["SGLANG_RETURN_ORIGINAL_LOGPROB=1", "python", "-m", "sglang.launch_server"]
        argvs.append([("30000" if w == "PORT" else w) for w in words[4:]])  # a free port at start
    want = {
        "unknown": [],
        "moe_a2a_backend": "deepep",
        "kv_cache_dtype": "fp8_e4m3",
        "max_running_requests": engines.max_batch,
        "tp_size": engines.tp,
        "ep_size": engines.ep,
        "mem_fraction_static": engines.mem_fraction_static,
    }
    assert sglang_oracle.call(_parse_launches, argvs) == [want] * engines.count
    assert "kv_cache_dtype fp8_e4m3: 1 B a value" in done.stdout


def _nearest_flag(flag: str) -> dict:
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    known = [o for a in parser._actions for o in a.option_strings]
    return {"known": flag in known, "nearest": difflib.get_close_matches(flag, known, n=1)}


def test_a_mistyped_option_exits_2_naming_the_one_sglang_has(sglang):
    done = _plan("engines.sglang.moe_a2a_backnd=deepep")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("moe-rl: error: engines.sglang.moe_a2a_backnd: ")
    assert "did you mean moe_a2a_backend?" in done.stderr
    assert sglang["nearest"] == {"known": False, "nearest": ["--moe-a2a-backend"]}
