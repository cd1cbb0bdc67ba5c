"""The SGLang launcher's command line against SGLang 0.5.23's own argument parser (conformance tier).

`sglang_command(...)` without its leading `python -m sglang.launch_server` is parsed by
`ServerArgs.add_cli_args` + `parse_args` and `ServerArgs.from_cli_args`: no unknown flag, and the
parsed server args are what the config asked for. dp_size > 1 never reaches a launch.
"""

from __future__ import annotations

import pytest

from moe_rl.config import EngineConfig
from moe_rl.engine import sglang_launcher
from moe_rl.engine.sglang_launcher import SERVER_ENV, SGLangConfig, SGLangLoRA, sglang_command
from sync.delta import SGLANG_LOADER
from tests.conformance import sglang_oracle

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

CHECKED = (
    "model_path",
    "host",
    "port",
    "tp_size",
    "ep_size",
    "dp_size",
    "attn_dp_size",
    "mem_fraction_static",
    "weight_version",
    "base_gpu_id",
    "skip_tokenizer_init",
    "enable_return_routed_experts",
    "enable_memory_saver",
    "enable_lora",
    "max_lora_rank",
    "lora_target_modules",
    "max_loaded_loras",
    "max_loras_per_batch",
    "attention_backend",
    "max_running_requests",
    "custom_weight_loader",
)

CONFIGS = {
    "disaggregated": SGLangConfig(
        model_path="/models/qwen3",
        tp_size=4,
        ep_size=4,
        mem_fraction_static=0.85,
        weight_version="3",
        base_gpu_id=4,
        max_running_requests=256,
    ),
    "colocated": SGLangConfig(
        model_path="/models/qwen3", tp_size=2, ep_size=2, mem_fraction_static=0.5, enable_memory_saver=True
    ),
    "lora": SGLangConfig(
        model_path="/models/qwen3",
        lora=SGLangLoRA(
            max_lora_rank=16, target_modules=["q_proj", "v_proj"], max_loaded_loras=4, max_loras_per_batch=2
        ),
    ),
    "delta": SGLangConfig(  # sync.delta over cuda_ipc: the delta loader registered
        model_path="/models/qwen3", enable_memory_saver=True, custom_weight_loader=SGLANG_LOADER
    ),
    "attention_dp": SGLangConfig(
        model_path="/models/dsv3", tp_size=8, ep_size=8, attn_dp_size=4, options={"attention_backend": "fa3"}
    ),
}


def _parse(argv: list[str]) -> dict:
    """SGLang's own parse of `argv`: the parsed namespace and the ServerArgs built from it."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    namespace, unknown = parser.parse_known_args(argv)
    args = ServerArgs.from_cli_args(namespace)
    return {
        "unknown": unknown,
        "namespace": {k: getattr(namespace, k, None) for k in CHECKED},
        "server_args": {k: getattr(args, k, None) for k in CHECKED},
    }


def expected(config: SGLangConfig, port: int) -> dict:
    lora = config.lora
    return {
        "model_path": config.model_path,
        "host": config.host,
        "port": port,
        "tp_size": config.tp_size,
        "ep_size": config.ep_size,
        "dp_size": 1,
        "attn_dp_size": config.attn_dp_size,
        "mem_fraction_static": config.mem_fraction_static,
        "weight_version": config.weight_version,
        "base_gpu_id": config.base_gpu_id,
        "skip_tokenizer_init": True,
        "enable_return_routed_experts": True,
        "enable_memory_saver": config.enable_memory_saver,
        "enable_lora": True if lora else None,
        "max_lora_rank": lora and lora.max_lora_rank,
        "lora_target_modules": lora and lora.target_modules,
        "max_loaded_loras": lora and lora.max_loaded_loras,
        "max_loras_per_batch": lora.max_loras_per_batch if lora else 8,
        "attention_backend": config.options.get("attention_backend"),
        "max_running_requests": config.max_running_requests,
        "custom_weight_loader": [config.custom_weight_loader] if config.custom_weight_loader else None,
    }


@pytest.mark.parametrize("name", CONFIGS)
def test_sglangs_parser_takes_the_command_line(name):
    config, port = CONFIGS[name], 30007
    command = sglang_command(config, port)
    assert command[1:3] == ["-m", "sglang.launch_server"]
    parsed = sglang_oracle.call(_parse, command[3:])
    assert parsed["unknown"] == [], parsed["unknown"]
    want = expected(config, port)
    for where in ("namespace", "server_args"):
        got = dict(parsed[where])
        if got["lora_target_modules"] is not None:
            got["lora_target_modules"] = sorted(got["lora_target_modules"])
            want["lora_target_modules"] = sorted(want["lora_target_modules"])
        assert got == want, where


def test_dp_size_above_one_is_refused_before_launch():
    with pytest.raises(ValueError, match=r"dp_size=2: .*engines.count.*attn_dp_size \(--attn-dp-size\)"):
        SGLangConfig(model_path="/m", tp_size=2, dp_size=2)
    with pytest.raises(ValueError, match=r"engines.dp=2: .*engines.count.*engines.attn_dp"):
        EngineConfig(kind="sglang", tp=2, dp=2)
    with pytest.raises(ValueError, match="attn_dp_size=3 does not divide tp_size=4"):
        SGLangConfig(model_path="/m", tp_size=4, attn_dp_size=3)
    with pytest.raises(ValueError, match="max_loaded_loras=1 < max_loras_per_batch=2"):
        SGLangLoRA(max_lora_rank=8, target_modules=["all"], max_loaded_loras=1, max_loras_per_batch=2)


def _supported_lora_targets() -> list[str]:
    from sglang.srt.utils.common import SUPPORTED_LORA_TARGET_MODULES

    return list(SUPPORTED_LORA_TARGET_MODULES)


def test_lora_targets_are_the_ones_sglang_accepts():
    """The launcher checks targets against SGLang's argparse choices before launch: Mixtral's
    expert names (w1/w2/w3) would make SGLang exit; q/k/v/o, MLA's and gate/up/down pass."""
    from moe_rl.engine.sglang_launcher import SGLANG_LORA_TARGETS
    from parallel.bridges import bridge_for
    from parallel.lora import TARGETS
    from parallel.peft import hf_lora_targets
    from tests.tiny_models import DEEPSEEK_V3, GLM4_MOE, MIXTRAL, QWEN3_MOE, hf_config

    assert SGLANG_LORA_TARGETS == set(sglang_oracle.call(_supported_lora_targets))
    for family in (QWEN3_MOE, GLM4_MOE, DEEPSEEK_V3):
        SGLangLoRA(max_lora_rank=8, target_modules=hf_lora_targets(bridge_for(hf_config(family)), TARGETS))
    mixtral = hf_lora_targets(bridge_for(hf_config(MIXTRAL)), TARGETS)
    with pytest.raises(ValueError, match=r"LoRA targets \['w1', 'w2', 'w3'\] are not among SGLang"):
        SGLangLoRA(max_lora_rank=8, target_modules=mixtral)
    SGLangLoRA(
        max_lora_rank=8, target_modules=hf_lora_targets(bridge_for(hf_config(MIXTRAL)), ["linear_qkv", "linear_proj"])
    )


def test_the_server_returns_temperature_one_logprobs(monkeypatch):
    # srt/layers/sampler.py reads it with get_bool_env_var: "1" turns it on
    assert SERVER_ENV == {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}
    started = {}

    class Recorder:
        def __init__(self, command, host, port, log_path, env):
            started.update(command=command, env=env)

        def wait_healthy(self, timeout_s):
            return self

    monkeypatch.setattr(sglang_launcher, "EngineProcess", Recorder)
    sglang_launcher.launch_sglang(SGLangConfig(model_path="/m", port=30008), env={"CUDA_VISIBLE_DEVICES": "2"})
    assert started["env"] == {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1", "CUDA_VISIBLE_DEVICES": "2"}
