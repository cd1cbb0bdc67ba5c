"""The rollout side of the async RL loop (docs/architecture.md section 2: generation, buffer, partial rollouts).

- `config`: `RolloutConfig` (task or task mixture, reward, sampling, staleness, partial-rollout options).
- `manager`: `RolloutManager`, generates scored groups through the `EnginePool` into the buffer,
  continues requests cut by a weight-swap pause.
- `buffer`: `RolloutBuffer`, staleness-bounded admission and consumption, group ledger, metrics.
- `partial`: `continue_sample` and the continuation request of a partial sample.
- `dump`: per-step JSONL records of trained (and evaluation) samples (`rollout.dump`, `moe-rl samples`).
"""

from moe_rl.rollout.buffer import RolloutBuffer, staleness
from moe_rl.rollout.config import RolloutConfig
from moe_rl.rollout.manager import RolloutManager
from moe_rl.rollout.partial import continue_sample

__all__ = ["RolloutBuffer", "RolloutConfig", "RolloutManager", "continue_sample", "staleness"]
