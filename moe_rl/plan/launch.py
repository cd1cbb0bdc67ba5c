"""Each RL engine's SGLang launch: `engine_sglang_config` (from the run's engines section), which
`EngineServer` and the evaluation job start, and the command `moe-rl plan` prints from it with the
launcher's own `sglang_command` and `SERVER_ENV`, so the two cannot differ.

What only the start knows is written as a placeholder: RUN_DIR (the run directory, whose
`initial_hf/` the engines load), NODE<n> (the address of the engine's node) and PORT (a free port).
Colocated engines (`rl.colocate`) run on their trainer ranks' GPUs (CUDA_VISIBLE_DEVICES); the
others on the GPUs Ray gives them, as placed by the plan.
"""

from __future__ import annotations

import shlex

from moe_rl.config import EngineConfig, RunConfig
from moe_rl.engine.sglang_launcher import SERVER_ENV, SGLangConfig, SGLangLoRA, sglang_command
from sync.delta import SGLANG_LOADER


def engine_commands(config: RunConfig) -> list[str]:
    """One line per engine: its environment and `python -m sglang.launch_server ...`."""
    engines, colocated = config.engines, config.rl.colocate
    per_node, lora = config.cluster.gpus_per_node, sglang_lora_slots(config)
    lines = []
    for i in range(engines.count):
        first = (0 if colocated else config.trainer.world_size) + i * engines.tp
        launch = engine_sglang_config(
            engines, "RUN_DIR/initial_hf", host=f"NODE{first // per_node}", weight_version="0",
            colocated=colocated, lora=lora, delta=config.sync.delta.enabled,
        )  # fmt: skip
        env = dict(SERVER_ENV)
        if colocated:  # launch_sglang's env: the trainer ranks' GPUs of the node
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g % per_node) for g in range(first, first + engines.tp))
        command = ["python", *sglang_command(launch, "PORT")[1:]]  # the engine node's interpreter
        lines.append(f"engine {i}: " + " ".join(f"{k}={v}" for k, v in env.items()) + " " + shlex.join(command))
    return lines


def engine_sglang_config(
    engines: EngineConfig,
    model_path: str,
    *,
    host: str,
    weight_version: str,
    colocated: bool = False,
    lora: SGLangLoRA | None = None,
    delta: bool = False,
) -> SGLangConfig:
    """One RL engine's SGLang launch from `engines` (the engines section): what `EngineServer`
    starts, the evaluation job starts, and `moe-rl plan` prints. `colocated`: on the trainer's GPUs
    (`--enable-memory-saver`); `lora`: the adapter slots (`sglang_lora_slots`); `delta`: updates
    come as `sync.delta` payloads (`--custom-weight-loader` of `moe_rl.engine.sglang_delta`)."""
    return SGLangConfig(
        model_path=model_path,
        host=host,
        tp_size=engines.tp,
        ep_size=engines.ep,
        attn_dp_size=engines.attn_dp,
        mem_fraction_static=engines.mem_fraction_static,
        max_running_requests=engines.max_batch,
        weight_version=weight_version,
        enable_memory_saver=colocated,
        lora=lora,
        speculative_steps=engines.speculative.steps if engines.speculative is not None else 0,
        custom_weight_loader=SGLANG_LOADER if delta else None,
        options=dict(engines.sglang),
    )


def sglang_lora_slots(config: RunConfig) -> SGLangLoRA | None:
    """SGLang's LoRA serving flags sized from the run config (None without `lora`): every kept
    version, plus one being loaded, may be resident and mixed in a batch."""
    if config.lora is None:
        return None
    # heavy: transformers (the model's HF config) and the bridges, only for LoRA runs
    from parallel.bridges import bridge_for
    from parallel.peft import hf_lora_targets

    slots = config.effective_rollout().max_staleness + 2
    targets = hf_lora_targets(bridge_for(config.model.load_hf_config()), config.lora.targets)
    return SGLangLoRA(
        max_lora_rank=config.lora.rank, target_modules=targets, max_loaded_loras=slots, max_loras_per_batch=slots
    )
