"""Every SGLang 0.5.23 server option (`engines.sglang: {option: value}`): the table, its checks, its argv.

The table, `sglang_options.json` beside this module, lists SGLang 0.5.23's server options as its
own argparse parser declares them (`ServerArgs.add_cli_args`): per option its flag, aliases, kind
(`flag`: store_true; `bool`: `--x`/`--no-x`; `value`; `list`: nargs + or *; `deprecated`), value
type and choices. `scripts/sglang_options.py` writes it from SGLang's own code (`read_parser`, run
where SGLang's modules import: the conformance tier's oracle), and
`tests/conformance/test_sglang_options.py` checks it against that code.

`check_options` is all moe-rl checks before a start, offline: the names (an unknown one is refused
with the nearest name), the value types and choices, and the cross-field rules in RULES. It never
runs SGLang's GPU, package or model checks: those stay at launch. Options moe-rl sets itself are
refused with the field that owns them (OWNED). An option is written with its flag's name
(`moe_a2a_backend` for `--moe-a2a-backend`; an alias such as `ep` for `--ep-size` names the same
option); `option_args` turns the checked options into the command line `sglang_command` appends.
"""

from __future__ import annotations

import difflib
import functools
import json
from pathlib import Path
from typing import Any

TABLE = Path(__file__).with_name("sglang_options.json")
SGLANG_VERSION = "0.5.23"

OWNED = {
    "model_path": "engines load the run's checkpoint (model.path, exported to RUN_DIR/initial_hf)",
    "host": "moe-rl starts each engine on its Ray node",
    "port": "moe-rl picks a free port per engine",
    "skip_tokenizer_init": "moe-rl sends token ids (always on)",
    "weight_version": "the weight sync labels versions (sync.*)",
    "custom_weight_loader": "the weight sync loads updates through SGLang's own loader (sync.*)",
    "enable_return_routed_experts": "always on (routing replay reads it: rollout.return_routed_experts)",
    "tp_size": "set engines.tp",
    "ep_size": "set engines.ep",
    "attn_dp_size": "set engines.attn_dp",
    "dp_size": "set engines.count for more replicas (engines.dp must stay 1)",
    "enable_dp_attention": "set engines.attn_dp (--attn-dp-size)",
    "mem_fraction_static": "set engines.mem_fraction_static",
    "max_running_requests": "set engines.max_batch",
    "base_gpu_id": "moe-rl places engines on GPUs (cluster.md)",
    "enable_memory_saver": "set rl.colocate",
    "enable_lora": "set lora (adapter serving slots follow it)",
    "max_lora_rank": "set lora.rank",
    "lora_target_modules": "set lora.targets",
    "max_loaded_loras": "set lora (slots follow rollout.max_staleness)",
    "max_loras_per_batch": "set lora (slots follow rollout.max_staleness)",
    "lora_paths": "moe-rl loads adapters itself (lora)",
    "config": "write the options in engines.sglang",
}
"""Options moe-rl sets itself -> the field that owns them (refused in `engines.sglang`)."""
SPECULATIVE = "speculative_"
"""Every option starting so is speculative decoding's: `engines.speculative` owns them."""

KV_CACHE_BYTES = {
    "bf16": 2.0,
    "bfloat16": 2.0,
    "fp8_e4m3": 1.0,
    "fp8_e5m2": 1.0,
    "mxfp8": 1.0 + 1 / 32,  # a UE8M0 scale per 32 values
    "nvfp4": 0.5 + 1 / 16,  # two values a byte, a one-byte scale per 16
    "fp4_mx_block16": 0.5 + 1 / 16,
}
"""Bytes of a cached key or value per `kv_cache_dtype` (SGLang's `configure_kv_cache_dtype` and
its KV pools); "auto" is the model's dtype."""


@functools.cache
def table() -> dict:
    """The shipped table: {"sglang": version, "options": {name: entry}, "ep_spanning_a2a_backends": [...]}."""
    return json.loads(TABLE.read_text())


@functools.cache
def _aliases() -> dict[str, str]:
    return {alias: name for name, entry in table()["options"].items() for alias in entry.get("aliases", [])}


def _name_of(key: str) -> str | None:
    key = key.replace("-", "_").lstrip("_")
    return key if key in table()["options"] else _aliases().get(key)


def check_options(options: dict, *, tp: int, ep: int, where: str = "engines.sglang") -> None:
    """ValueError (one line, naming `where.NAME` and the fix) for an option SGLang 0.5.23 does not
    have, one moe-rl owns, a value of the wrong type or outside its choices, or a broken RULES rule.
    `tp`, `ep`: the engine's sizes (engines.tp, engines.ep) the rules read."""
    if not isinstance(options, dict):
        raise ValueError(f"{where}={options!r}: expected a mapping of SGLang server options")
    for key, value in options.items():
        name = _name_of(str(key))
        if name is None:
            known = [*table()["options"], *_aliases()]
            close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
            hint = f"; did you mean {_aliases().get(close[0], close[0])}?" if close else ""
            raise ValueError(
                f"{where}.{key}: not a server option of SGLang {SGLANG_VERSION}{hint} "
                f"(the table: moe_rl/engine/{TABLE.name})"
            )
        entry = table()["options"][name]
        if name in OWNED or entry["dest"] in OWNED:
            raise ValueError(
                f"{where}.{key}: moe-rl sets this option itself; {OWNED.get(name) or OWNED[entry['dest']]}"
            )
        if name.startswith(SPECULATIVE):
            raise ValueError(
                f"{where}.{key}: speculative decoding is configured by engines.speculative (moe-rl keeps the "
                "draft in step with the policy); set it there"
            )
        if entry["kind"] == "deprecated":
            raise ValueError(f"{where}.{key}: deprecated in SGLang {SGLANG_VERSION}; use {entry['replacement']}")
        _values(entry, value, f"{where}.{key}")
    resolved = {_name_of(str(key)): value for key, value in options.items()}
    if len(resolved) < len(options):
        raise ValueError(f"{where}={options}: names one option twice (an alias and its name); keep one")
    for rule in RULES:
        rule(resolved, tp, ep, where)


def option_args(options: dict) -> list[str]:
    """The command-line arguments of checked `options` (`check_options`), in their order."""
    argv: list[str] = []
    for key, value in options.items():
        entry = table()["options"][_name_of(str(key))]
        flag = entry["flag"]
        if entry["kind"] == "flag":
            argv += [flag] if value else []
        elif entry["kind"] == "bool":
            argv.append(flag if value else "--no-" + flag[2:])
        elif entry["kind"] == "list":
            argv += [flag, *(_text(v) for v in _as_list(value))]
        else:
            argv += [flag, _text(value)]
    return argv


def option_value(options: dict, name: str, default: Any = None) -> Any:
    """The value `options` give option `name` (written as its name or an alias), else `default`."""
    return next((v for k, v in options.items() if _name_of(str(k)) == name), default)


def kv_cache_bytes(options: dict, model_bytes: float) -> float:
    """Bytes of a cached key or value under `kv_cache_dtype` (`model_bytes` for "auto", the default)."""
    return KV_CACHE_BYTES.get(option_value(options, "kv_cache_dtype", "auto"), model_bytes)


# -- values --------------------------------------------------------------------------------------
JSON_TYPES = ("loads", "json_list_type")
"""Parsers of JSON text: a mapping or list in YAML is passed as JSON."""


def _values(entry: dict, value: Any, name: str) -> None:
    if value is None:
        raise ValueError(f"{name}=null: remove it to keep SGLang's default")
    if entry["kind"] in ("flag", "bool"):
        if not isinstance(value, bool):
            raise ValueError(f"{name}={value!r}: {entry['flag']} is a switch; write true or false")
        if entry["kind"] == "flag" and not value and entry.get("default"):
            raise ValueError(f"{name}=false: {entry['flag']} is on by default and cannot be turned off")
        return
    if entry["kind"] == "list":
        items = _as_list(value)
        if not items and entry["nargs"] == "+":
            raise ValueError(f"{name}=[]: {entry['flag']} takes one value or more")
        for item in items:
            _value(entry, item, name)
        return
    _value(entry, value, name)


def _value(entry: dict, value: Any, name: str) -> None:
    kind = entry["type"]
    if isinstance(value, (dict, list)) and kind not in JSON_TYPES:
        raise ValueError(f"{name}={value!r}: {entry['flag']} takes one {kind} value")
    if kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{name}={value!r}: expected an integer")
    if kind == "float" and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ValueError(f"{name}={value!r}: expected a number")
    if isinstance(value, bool) and kind != "float":
        raise ValueError(f"{name}={value!r}: expected a {kind} value, not a switch")
    choices = entry.get("choices")
    if choices is not None and value not in choices and _text(value) not in map(str, choices):
        raise ValueError(f"{name}={value!r}: {entry['flag']} takes one of {choices}")


def _as_list(value: Any) -> list:
    return value if isinstance(value, list) else [value]


def _text(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (dict, list)) else str(value)


# -- cross-field rules ----------------------------------------------------------------------------
def _a2a_spans_the_engine(options: dict, tp: int, ep: int, where: str) -> None:
    """SGLang's `_a2a_ep_size` (arg_groups/overrides.py) resets ep_size to tp_size under these
    backends: the plan would size experts by engines.ep while SGLang spreads them over tp GPUs."""
    backend = options.get("moe_a2a_backend", "none")
    if backend in table()["ep_spanning_a2a_backends"] and ep != tp:
        raise ValueError(
            f"{where}.moe_a2a_backend={backend} spreads experts over all engines.tp={tp} GPUs (SGLang sets "
            f"ep_size = tp_size), but engines.ep={ep}: set engines.ep={tp}"
        )


def _eplb_needs_ep(options: dict, tp: int, ep: int, where: str) -> None:
    """SGLang's `handle_eplb_and_dispatch` (arg_groups/parallel_hook.py): EPLB asserts ep_size > 1
    (unless elastic EP scales; an all-to-all backend's ep_size is engines.ep by the rule above), and
    static/lp dispatch needs an all-to-all backend."""
    if options.get("enable_eplb") and options.get("elastic_ep_join_mode") != "scale" and ep < 2:
        raise ValueError(f"{where}.enable_eplb: EPLB balances experts across EP ranks; set engines.ep > 1")
    dispatch = options.get("ep_dispatch_algorithm")
    if dispatch in ("static", "lp") and options.get("moe_a2a_backend", "none") == "none":
        raise ValueError(
            f"{where}.ep_dispatch_algorithm={dispatch} picks a replica per rank, which needs an all-to-all "
            "backend: set engines.sglang.moe_a2a_backend, or ep_dispatch_algorithm: dynamic"
        )


RULES = (_a2a_spans_the_engine, _eplb_needs_ep)
"""The cross-field rules checked before start (each names the SGLang code it mirrors)."""


# -- the generator's side (runs where SGLang's modules import) -----------------------------------
def read_parser() -> dict:
    """The table, read from SGLang's own parser (`ServerArgs.add_cli_args`) and
    `_A2A_EP_SPANNING_BACKENDS`: what `scripts/sglang_options.py` writes to TABLE."""
    import argparse  # SGLang's parser is argparse's

    from sglang.srt.arg_groups.overrides import _A2A_EP_SPANNING_BACKENDS
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    options = {}
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        flag, *others = action.option_strings
        negated = isinstance(action, argparse.BooleanOptionalAction)
        aliases = [
            o[2:].replace("-", "_") for o in others if o.startswith("--") and not (negated and o.startswith("--no-"))
        ]
        entry: dict[str, Any] = {"flag": flag, "dest": action.dest}
        if aliases:
            entry["aliases"] = aliases
        new_flag = getattr(action, "new_flag", None)
        if new_flag is not None:
            entry.update(kind="deprecated", replacement=new_flag)
        elif negated:
            entry["kind"] = "bool"
        elif action.nargs == 0:
            entry.update(kind="flag", default=bool(action.default))
        else:
            entry["kind"] = "list" if action.nargs in ("+", "*") else "value"
            entry["type"] = getattr(action.type, "__name__", "str") if action.type else "str"
            if action.nargs in ("+", "*"):
                entry["nargs"] = action.nargs
        if action.choices is not None and entry["kind"] != "deprecated":
            entry["choices"] = (
                sorted(action.choices, key=str) if isinstance(action.choices, set) else list(action.choices)
            )
        options[flag[2:].replace("-", "_")] = entry
    return {
        "sglang": SGLANG_VERSION,
        "options": dict(sorted(options.items())),
        "ep_spanning_a2a_backends": sorted(_A2A_EP_SPANNING_BACKENDS),
    }
