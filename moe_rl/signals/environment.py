"""`EnvironmentConfig` (`rollout.environment`, an eval dataset's `environment`) and the adapter
each `kind` names.

An environment is a prompt source with its own scorer, from an outside package:
- `verifiers`: a verifiers environment's taskset; episodes through the OpenAI endpoint, the
  taskset's rewards (`moe_rl.signals.verifiers_env`);
- `openenv`: an OpenEnv server through its client (`moe_rl.signals.openenv_env`);
- `reasoning_gym`: reasoning-gym's procedural datasets and their `score_answer`
  (`moe_rl.signals.reasoning_gym_task`).
Each adapter builds a `moe_rl.tasks.Task`: prompts, a reward that the run's `RewardScorer` calls
(errors and timeouts counted, never fatal) and, for the kinds that run episodes, the task's own
`agent` (`Task.agent`). The packages are the optional extra `envs` (`pip install
'moe-rl[envs]'`); a missing package, an unknown name or a wrong signature is a ValueError that
names the field, raised by the driver's checks before any process starts.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from moe_rl.tasks import Task

ADAPTERS = {
    "verifiers": ("moe_rl.signals.verifiers_env", "verifiers"),
    "openenv": ("moe_rl.signals.openenv_env", "openenv-core"),
    "reasoning_gym": ("moe_rl.signals.reasoning_gym_task", "reasoning-gym"),
}
EPISODE_KINDS = ("verifiers", "openenv")
"""Kinds whose prompts are chat episodes (the agents path: `rollout.episode` applies)."""


@dataclass(kw_only=True)
class EnvironmentConfig:
    kind: str
    """The adapter: "verifiers", "openenv" or "reasoning_gym" (docs/signals.md)."""
    name: str
    """verifiers: the environment's module or hub id (its taskset); openenv: the server's URL
    (http://host:port), or the module of its app (`package.server.app`, started on a free local
    port); reasoning_gym: dataset names, comma-separated."""
    options: dict[str, Any] = field(default_factory=dict)
    """Passed to the environment: the verifiers taskset's config fields, OpenEnv's reset
    arguments and keys, reasoning-gym's dataset config (docs/signals.md)."""

    def __post_init__(self):
        if self.kind not in ADAPTERS:
            raise ValueError(f"rollout.environment.kind={self.kind!r}: use one of {sorted(ADAPTERS)}")
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"rollout.environment.name={self.name!r}: name the {self.kind} environment")
        if not isinstance(self.options, dict):
            raise ValueError(f"rollout.environment.options={self.options!r}: must be a mapping")

    @property
    def episodes(self) -> bool:
        return self.kind in EPISODE_KINDS


def make_environment_task(config: EnvironmentConfig, tokenizer_dir: str | None, field_name: str) -> Task:
    """The adapter's task for `config`; ValueError naming `field_name` when the package is
    missing or the environment does not load."""
    module_name, package = ADAPTERS[config.kind]
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(
            f"{field_name}.kind={config.kind!r} needs the package {package!r} ({error}): pip install 'moe-rl[envs]'"
        ) from None
    try:
        return module.make_task(config.name, dict(config.options), tokenizer_dir)
    except ValueError as error:
        raise ValueError(f"{field_name}: {error}") from None
    except Exception as error:  # the environment's own code failed while loading
        raise ValueError(
            f"{field_name}={{kind: {config.kind}, name: {config.name!r}}} failed to load: "
            f"{type(error).__name__}: {error}"
        ) from error
