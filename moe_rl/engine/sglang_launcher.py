"""Launch SGLang (`python -m sglang.launch_server`) with what RL needs (GPU machines only).

Flags (SGLang 0.5.23 server args): `--skip-tokenizer-init` (we send `input_ids`),
`--enable-return-routed-experts` (routing replay), `--tp-size/--ep-size`, `--attn-dp-size` (DP
attention), `--mem-fraction-static`, `--weight-version` (the initial version), `--enable-memory-saver`
(colocated mode: release/resume memory around training), and the LoRA flags (`--enable-lora`,
`--max-lora-rank`, `--lora-target-modules`, `--max-loaded-loras`, `--max-loras-per-batch`; without
`--enable-lora` SGLang answers 400 to `/load_lora_adapter`), `--max-running-requests`
(`engines.max_batch`), speculative decoding with the MTP layer (`speculative_args`,
`engines.speculative`), then any other server option (`engines.sglang`, checked against SGLang's
table by `moe_rl.engine.sglang_options`). `moe_rl.plan.launch.engine_sglang_config` builds an RL
engine's `SGLangConfig` from the engines section: the launch and `moe-rl plan`'s printed command
both come from it. `--dp-size` is always 1: in 0.5.23 it runs data-parallel replicas behind one server,
whose weight-update and LoRA routes assert `dp_size == 1`; more replicas are more engines.

Logprobs: SGLang returns `log_softmax(logits / temperature)` unless `SGLANG_RETURN_ORIGINAL_LOGPROB=1`
(srt/layers/sampler.py); the trainer's importance ratios assume the temperature-1 logprobs of the
sampled tokens, so `launch_sglang` sets it for the server process. The process is an `EngineProcess`:
it waits for `/health`, keeps its log, and stops with SIGTERM then SIGKILL. sglang is never imported here.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

from moe_rl.engine.process import EngineProcess, free_port
from moe_rl.engine.sglang_options import check_options, option_args

SERVER_ENV = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}
"""Environment of every SGLang server process: logprobs of the model's own distribution (temperature 1)."""


SGLANG_LORA_TARGETS = frozenset(
    {
        *("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj"),
        *("q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj", "wq_b", "wk", "weights_proj"),
        *("gate_proj", "up_proj", "down_proj", "gate_up_proj", "embed_tokens", "lm_head", "qkvr", "wo_ud"),
    }
)
"""The names SGLang 0.5.23's `--lora-target-modules` accepts besides "all" (its argparse choices,
`SUPPORTED_LORA_TARGET_MODULES`; the conformance tests check this against SGLang's own list)."""


@dataclasses.dataclass(kw_only=True)
class SGLangLoRA:
    """SGLang's LoRA serving slots (adapters are loaded later with `/load_lora_adapter`)."""

    max_lora_rank: int
    """`--max-lora-rank`: the largest rank an adapter may have."""
    target_modules: list[str]
    """`--lora-target-modules`: modules adapters may touch (e.g. ["q_proj", "v_proj"], or ["all"])."""
    max_loaded_loras: int | None = None
    """`--max-loaded-loras`: adapters held in CPU memory at once (None: SGLang's default, unbounded);
    at least max_loras_per_batch."""
    max_loras_per_batch: int = 8
    """`--max-loras-per-batch`: adapters one running batch may mix (the base model counts as one)."""

    def __post_init__(self):
        if self.max_lora_rank < 1 or self.max_loras_per_batch < 1:
            raise ValueError(
                f"lora: max_lora_rank={self.max_lora_rank} and max_loras_per_batch="
                f"{self.max_loras_per_batch} must be >= 1"
            )
        if not self.target_modules:
            raise ValueError("lora.target_modules is empty: name the modules adapters touch, or ['all']")
        unknown = sorted(set(self.target_modules) - SGLANG_LORA_TARGETS - {"all"})
        if unknown:  # SGLang's argparse would exit at launch
            raise ValueError(
                f"LoRA targets {unknown} are not among SGLang 0.5.23's --lora-target-modules "
                f"({sorted(SGLANG_LORA_TARGETS)}): set lora.target_modules to Megatron modules whose HF "
                "names SGLang serves (Mixtral's experts are w1/w2/w3: adapt its attention only), or use "
                "the embedded engine"
            )
        if self.max_loaded_loras is not None and self.max_loaded_loras < self.max_loras_per_batch:
            raise ValueError(
                f"lora.max_loaded_loras={self.max_loaded_loras} < max_loras_per_batch="
                f"{self.max_loras_per_batch}: SGLang needs it >= max_loras_per_batch; raise it"
            )


@dataclasses.dataclass(kw_only=True)
class SGLangConfig:
    model_path: str
    """HF model directory or hub name SGLang loads."""
    host: str = "127.0.0.1"
    port: int | None = None
    """HTTP port; None picks a free one."""
    tp_size: int = 1
    """`--tp-size`: GPUs of the engine."""
    ep_size: int = 1
    """`--ep-size`: experts split over this many of the engine's GPUs."""
    dp_size: int = 1
    """`--dp-size`: must be 1 (see the module docstring); run more engines instead."""
    attn_dp_size: int = 1
    """`--attn-dp-size`: DP attention, the tp GPUs in attn_dp_size attention groups (divides tp_size)."""
    mem_fraction_static: float = 0.8
    """Fraction of GPU memory for weights + KV cache (lower it when colocated with the trainer)."""
    weight_version: str = "0"
    """`--weight-version`: the label of the launch weights."""
    enable_return_routed_experts: bool = True
    """`--enable-return-routed-experts`: answers carry the routing (routing replay)."""
    enable_memory_saver: bool = False
    """Colocated mode: lets the trainer release/resume the engine's GPU memory."""
    lora: SGLangLoRA | None = None
    """LoRA serving (`--enable-lora` and its slots); None: no adapters."""
    speculative_steps: int = 0
    """Speculative decoding with the model's MTP layer: draft tokens per verify (`speculative_args`); 0: off."""
    base_gpu_id: int = 0
    """`--base-gpu-id`: the first GPU the engine uses."""
    max_running_requests: int | None = None
    """`--max-running-requests`: most requests the engine runs together (None: SGLang sizes it)."""
    custom_weight_loader: str | None = None
    """`--custom-weight-loader`: an import path SGLang may load updates with (`load_format`); the
    delta sync's `moe_rl.engine.sglang_delta.LOAD_FORMAT`, else None."""
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Any other server option by its flag's name (e.g. {"attention_backend": "fa3"}), checked by
    `moe_rl.engine.sglang_options.check_options`."""

    def __post_init__(self):
        for name in ("tp_size", "ep_size", "dp_size", "attn_dp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.dp_size > 1:
            raise ValueError(
                f"dp_size={self.dp_size}: SGLang 0.5.23's --dp-size runs {self.dp_size} replicas behind one "
                "server and its weight-update and LoRA routes assert dp_size == 1; launch more engines "
                "(engines.count) instead, or for DP attention set attn_dp_size (--attn-dp-size)"
            )
        for name in ("ep_size", "attn_dp_size"):
            if self.tp_size % getattr(self, name):
                raise ValueError(
                    f"{name}={getattr(self, name)} does not divide tp_size={self.tp_size}: make it a divisor"
                )
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static={self.mem_fraction_static} must be in (0, 1)")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise ValueError(f"max_running_requests={self.max_running_requests} must be >= 1")
        check_options(self.options, tp=self.tp_size, ep=self.ep_size, where="options")


def sglang_command(config: SGLangConfig, port: int | str) -> list[str]:
    """`python -m sglang.launch_server ...` of `config` on `port` (`moe-rl plan` prints it with
    "PORT": a free port is picked at launch)."""
    command = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        config.model_path,
        "--host",
        config.host,
        "--port",
        str(port),
        "--tp-size",
        str(config.tp_size),
        "--ep-size",
        str(config.ep_size),
        "--dp-size",
        str(config.dp_size),
        "--attn-dp-size",
        str(config.attn_dp_size),
        "--mem-fraction-static",
        str(config.mem_fraction_static),
        "--weight-version",
        config.weight_version,
        "--base-gpu-id",
        str(config.base_gpu_id),
        "--skip-tokenizer-init",
    ]
    if config.enable_return_routed_experts:
        command.append("--enable-return-routed-experts")
    if config.enable_memory_saver:
        command.append("--enable-memory-saver")
    if config.lora is not None:
        lora = config.lora
        command += [
            "--enable-lora",
            "--max-lora-rank",
            str(lora.max_lora_rank),
            "--lora-target-modules",
            *lora.target_modules,
            "--max-loras-per-batch",
            str(lora.max_loras_per_batch),
        ]
        if lora.max_loaded_loras is not None:
            command += ["--max-loaded-loras", str(lora.max_loaded_loras)]
    if config.max_running_requests is not None:
        command += ["--max-running-requests", str(config.max_running_requests)]
    if config.custom_weight_loader is not None:
        command += ["--custom-weight-loader", config.custom_weight_loader]
    return command + speculative_args(config.speculative_steps) + option_args(config.options)


def speculative_args(steps: int) -> list[str]:
    """SGLang 0.5.23's flags for `engines.speculative` (algorithm mtp, k = `steps`): NEXTN (the
    checkpoint's MTP layer as the EAGLE-style draft, loaded from the model path itself), a chain
    (`--speculative-eagle-topk 1`) of k steps, k + 1 tokens verified per forward. Weight syncs reach
    the draft through the same receive (SGLang fans each bucket out to target and draft runners,
    `SchedulerWeightUpdaterManager.update_weights_from_distributed`), and R3 rows come from the
    verifying forward (SGLang's capturer keeps routing per KV slot; the draft's capture is off)."""
    if not steps:
        return []
    return [
        "--speculative-algorithm",
        "NEXTN",
        "--speculative-num-steps",
        str(steps),
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        str(steps + 1),
    ]


def launch_sglang(
    config: SGLangConfig,
    log_path: str | Path | None = None,
    timeout_s: float = 900.0,
    env: dict[str, str] | None = None,
) -> EngineProcess:
    """Start SGLang and wait for `/health` (model loading and CUDA graphs can take minutes).
    The process gets SERVER_ENV (temperature-1 logprobs, see the module docstring); `env` adds to
    it (e.g. CUDA_VISIBLE_DEVICES of colocated engines)."""
    port = config.port or free_port(config.host)
    return EngineProcess(
        sglang_command(config, port), config.host, port, log_path, env={**SERVER_ENV, **(env or {})}
    ).wait_healthy(timeout_s)
