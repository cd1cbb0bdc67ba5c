"""A bad `rollout.environment` is refused before start, in one line that names the field and the
fix (`moe-rl train`, as a user runs it; Ray never starts); an environment's scorer that raises
scores 0, counted per call as every reward is."""

from __future__ import annotations

import pytest

from moe_rl.rollout import RolloutConfig
from moe_rl.rollout.scoring import RewardScorer
from moe_rl.sample import Sample
from tests.test_preflight import CHAT, refusal, write_config

VF_MODULES = {
    "vf_sandboxed": """
import verifiers.v1 as vf

class T(vf.Task):
    @vf.reward
    async def passed(self, trace, runtime) -> float:
        return 1.0

class S(vf.Taskset[T, vf.TasksetConfig]):
    def load(self):
        return [T(vf.TaskData(prompt="hi"), self.config.task)]

__all__ = ["S"]
""",
    "vf_raises": """
import verifiers.v1 as vf

class T(vf.Task):
    @vf.reward
    async def broken(self, trace) -> float:
        raise KeyError("no such column")

class S(vf.Taskset[T, vf.TasksetConfig]):
    def load(self):
        return [T(vf.TaskData(prompt="hi"), self.config.task)]

__all__ = ["S"]
""",
    "vf_import_fails": "import verifiers.v1 as vf\nimport no_such_dependency\n",
    "vf_two_agents": """
import verifiers.v1 as vf

class T(vf.Task):
    pass

class S(vf.Taskset[T, vf.TasksetConfig]):
    def load(self):
        return [T(vf.TaskData(prompt="hi"), self.config.task)]

class C(vf.EnvConfig):
    solver: vf.AgentConfig = vf.AgentConfig()
    critic: vf.AgentConfig = vf.AgentConfig()

class E(vf.Env[C]):
    async def run(self, task, agents):
        await agents.solver.run(task)

__all__ = ["S", "E"]
""",
    "vf_own_harness": """
import verifiers.v1 as vf

class T(vf.Task):
    pass

class S(vf.Taskset[T, vf.TasksetConfig]):
    def load(self):
        return [T(vf.TaskData(prompt="hi"), self.config.task)]

class H(vf.Harness[vf.HarnessConfig]):
    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data):
        raise NotImplementedError

__all__ = ["S", "H"]
""",
    "vf_docker_tools": """
import verifiers.v1 as vf

class Tools(vf.Toolset[vf.SharedToolsetConfig]):
    @vf.tool
    def echo(self, text: str) -> str:
        return text

class T(vf.Task):
    pass

class C(vf.TasksetConfig):
    tools: vf.SharedToolsetConfig = vf.SharedToolsetConfig(runtime={"type": "docker"})

class S(vf.Taskset[T, C]):
    def load(self):
        return [T(vf.TaskData(prompt="hi"), self.config.task)]

    @classmethod
    def toolsets(cls, config):
        return [Tools(config.tools)]

__all__ = ["S"]
""",
}


@pytest.fixture
def modules(tmp_path, monkeypatch):
    for name, text in VF_MODULES.items():
        (tmp_path / f"{name}.py").write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    import ray

    def refuse(*args, **kwargs):
        raise AssertionError("Ray was started for a config that preflight should refuse")

    monkeypatch.setattr(ray, "init", refuse)


def env(kind: str, name: str, **options) -> dict:
    return {
        "rollout.task": None,
        "model.tokenizer": CHAT,
        "rollout.environment": {"kind": kind, "name": name, "options": options},
    }


BAD = [
    # (overrides of tests/test_preflight.py's base config, fragments of the one-line error)
    (
        {**env("reasoning_gym", "basic_arithmetic"), "rollout.task": "copy_digits"},
        ["rollout.task with rollout.environment", "remove rollout.task"],
    ),
    (env("gym", "x"), ["rollout.environment.kind='gym'", "use one of"]),
    (env("reasoning_gym", "basic_arithmetic,no_such_set"), ["rollout.environment", "'no_such_set'", "not registered"]),
    (env("reasoning_gym", "basic_arithmetic", bogus=1), ["rollout.environment", "unexpected keyword argument 'bogus'"]),
    (env("verifiers", "no_such_env"), ["rollout.environment", "no module 'no_such_env'", "PYTHONPATH"]),
    (
        env("verifiers", "vf_import_fails"),
        ["rollout.environment", "importing 'vf_import_fails' failed", "no_such_dependency"],
    ),
    (env("verifiers", "vf_sandboxed"), ["rollout.environment", "['passed'] need a runtime"]),
    (env("verifiers", "vf_two_agents"), ["rollout.environment", "of 2 agents (solver, critic)", "one agent seat"]),
    (env("verifiers", "vf_own_harness"), ["rollout.environment", "its own harness program", "chat harness"]),
    (
        env("verifiers", "vf_docker_tools"),
        ["rollout.environment", "tool servers ['tools'] run in a container", "{type: subprocess}"],
    ),
    (env("openenv", "http://127.0.0.1:1", bogus=1), ["rollout.environment", "options has 'bogus'"]),
    (env("openenv", "no_such_app_module"), ["rollout.environment", "cannot import 'no_such_app_module'"]),
]


@pytest.mark.parametrize(
    "overrides,fragments", BAD, ids=[f"{i}-{case[0]['rollout.environment']['kind']}" for i, case in enumerate(BAD)]
)
def test_a_bad_environment_is_refused_before_start(tmp_path, modules, capsys, overrides, fragments):
    err = refusal(capsys, ["train", write_config(tmp_path, modules, overrides)])
    assert all(fragment in err for fragment in fragments), err
    assert not (tmp_path / "run").exists()


def test_a_scorer_that_raises_scores_zero_counted(modules):
    from moe_rl.signals.verifiers_env import make_task

    task = make_task("vf_raises", {}, None)
    prompt = next(task.prompts(0))
    scorer = RewardScorer(task.reward, timeout_s=30, workers=1)
    sample = Sample(
        prompt_ids=[1], metadata={"conversation": [*prompt.messages, {"role": "assistant", "content": "a"}]}
    )
    assert [scorer.score_blocking("a", prompt.answer, sample) for _ in range(2)] == [0.0, 0.0]
    assert scorer.metrics() == {"rollout/reward_errors": 2, "rollout/reward_timeouts": 0}


@pytest.mark.world  # starts uvicorn, whose app fails
def test_an_openenv_server_that_fails_is_refused(tmp_path, modules, capsys):
    (modules / "openenv_fails.py").write_text("app = None  # not an ASGI app: uvicorn exits\n")
    err = refusal(capsys, ["train", write_config(tmp_path, modules, env("openenv", "openenv_fails"))])
    assert "rollout.environment" in err and "the OpenEnv server did not start" in err, err


def test_an_eval_environment_keeps_its_own_episodes_and_reward():
    from moe_rl.rollout.eval_config import EvalDatasetConfig
    from moe_rl.signals.environment import EnvironmentConfig

    environment = EnvironmentConfig(kind="reasoning_gym", name="basic_arithmetic")
    with pytest.raises(ValueError, match="may be endless: set num_prompts"):
        EvalDatasetConfig(name="gym", environment=environment)
    with pytest.raises(ValueError, match="runs its own episodes and reward: remove agent and reward"):
        EvalDatasetConfig(name="gym", environment=environment, num_prompts=2, reward="math")
    with pytest.raises(ValueError, match="exactly one of path"):
        EvalDatasetConfig(name="gym", environment=environment, task="copy_digits", num_prompts=2)
    rollout = RolloutConfig(reward="math", temperature=0.5)  # a run whose own task is graded by math
    resolved = EvalDatasetConfig(name="gym", environment=environment, num_prompts=2).resolved(rollout)
    assert resolved.reward is None and resolved.agent is None and resolved.temperature == 0.5
    assert RolloutConfig().task == "copy_digits"  # no environment: the default task
