"""Each engine's SGLang launch command, as `moe-rl plan` prints it: built by the launcher code that
starts the engines (`engine_sglang_config`, `sglang_command`, `SERVER_ENV`), so the two cannot differ.

What only the start knows is written as a placeholder: RUN_DIR (the run directory, whose
`initial_hf/` the engines load), NODE<n> (the address of the engine's node) and PORT (a free port).
Colocated engines (`rl.colocate`) run on their trainer ranks' GPUs (CUDA_VISIBLE_DEVICES); the
others on the GPUs Ray gives them, as placed by the plan.
"""

from __future__ import annotations

import shlex

from moe_rl.config import RunConfig
from moe_rl.engine.sglang_launcher import SERVER_ENV, engine_sglang_config, sglang_command, sglang_lora_slots


def engine_commands(config: RunConfig) -> list[str]:
    """One line per engine: its environment and `python -m sglang.launch_server ...`."""
    engines, colocated = config.engines, config.rl.colocate
    per_node, lora = config.cluster.gpus_per_node, sglang_lora_slots(config)
    lines = []
    for i in range(engines.count):
        first = (0 if colocated else config.trainer.world_size) + i * engines.tp
        launch = engine_sglang_config(
            engines, "RUN_DIR/initial_hf", host=f"NODE{first // per_node}", weight_version="0",
            colocated=colocated, lora=lora,
        )  # fmt: skip
        env = dict(SERVER_ENV)
        if colocated:  # launch_sglang's env: the trainer ranks' GPUs of the node
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g % per_node) for g in range(first, first + engines.tp))
        command = ["python", *sglang_command(launch, "PORT")[1:]]  # the engine node's interpreter
        lines.append(f"engine {i}: " + " ".join(f"{k}={v}" for k, v in env.items()) + " " + shlex.join(command))
    return lines
