"""The recipes (`configs/recipes/`, docs/recipes.md) are checked by `moe-rl plan` as users check them:
each places on its cluster and fits its GPUs, with evaluation and rollout dumps on."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_rl import cli
from moe_rl.config import load_config

RECIPES = sorted(Path("configs/recipes").glob("*.yaml"))


def test_the_recipes_cover_math_and_agents():
    configs = [load_config(path) for path in RECIPES]
    assert any(c.rollout.reward == "math" and c.rollout.answer_key == "reward_model.ground_truth" for c in configs)
    assert any(c.rollout.agent is not None and c.model.hf_config["model_type"] in ("glm4_moe", "deepseek_v3")
               for c in configs)  # fmt: skip


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_plans_with_eval_and_dumps_on(path, capsys):
    assert cli.main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert "placement:" in out and "trainer memory per GPU" in out
    config = load_config(path)
    assert config.rollout.dump and config.eval is not None and config.eval.every > 0
    for dataset in config.eval.datasets:
        resolved = dataset.resolved(config.rollout)
        assert resolved.max_new_tokens == config.rollout.max_new_tokens  # unset fields come from the rollout
        assert resolved.n_samples_per_prompt > 1  # pass@k needs several samples per prompt
