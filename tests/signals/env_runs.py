"""A short RL run on an environment (Ray, Megatron EP2, a real embedded engine, the tiny chat
tokenizer) and its dumped records, for the environment tests."""

from __future__ import annotations

import json
import os
from pathlib import Path

from moe_rl.agents import ChatFormat
from moe_rl.rollout.dump import SampleDump
from tests.agents.conftest import CHAT_DIR, save_chat_model

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
STEPS = 2
CHAT = ChatFormat.load(CHAT_DIR)


def run_environment(
    tmp_path: Path, environment: dict, emits: str, evaluate: dict | None = None, **rollout
) -> tuple[list[dict], list[dict]]:
    """Train STEPS steps of 2 groups x 2 samples on `environment` with a model that emits the
    token `emits` at every step, and evaluate the final policy on the eval dataset `evaluate`;
    returns (metrics rows, dumped sample records)."""
    from moe_rl.config import RunConfig, from_dict
    from moe_rl.jobs import rl

    (token,) = CHAT.encode(emits)
    model = save_chat_model(tmp_path / "model", emits=token)
    config = {
        "model": {"path": str(model), "tokenizer": str(CHAT_DIR)},
        "trainer": {"world_size": 2, "ep": 2, "micro_batch_size": 2, "global_batch_size": 4},
        "rollout": {
            "environment": environment,
            "groups_per_step": 2,
            "n_samples_per_prompt": 2,
            "max_staleness": 0,
            "dump": True,
            **rollout,
        },
        "sync": {"pause_mode": "abort", "bucket_bytes": 1 << 20},
        "rl": {"mode": "sync", "report": False, "save_hf": False},
        "eval": {"datasets": [evaluate]} if evaluate else None,
        "steps": STEPS,
        "output_dir": str(tmp_path / "run"),
    }
    rl.run(from_dict(RunConfig, config))
    metrics = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    records = [r for step in range(1, STEPS + 1) for r in SampleDump(tmp_path / "run" / "rollouts").read(step)]
    return metrics, records
