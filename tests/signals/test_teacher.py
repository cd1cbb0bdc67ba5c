"""The served teacher on real embedded engines: `ServedModel` starts one from a path (and connects
to one by URL), `Teacher` scores each sample with its task's teacher, and the logprobs it keeps
are the teacher's own prefill logprobs of the response tokens (the same call made directly)."""

from __future__ import annotations

import asyncio

import pytest

from moe_rl.algorithms.config import ServedConfig
from moe_rl.config import EngineConfig
from moe_rl.engine.client import EngineClient
from moe_rl.sample import Sample
from moe_rl.signals.served import ServedModel
from moe_rl.signals.teacher import Teacher
from tests.signals.distill_helpers import TEACHER_MODEL
from tests.tiny_models import hf_config, save_random_model

pytestmark = pytest.mark.world  # starts engine processes (tests/conftest.py)


def sample(task: str | None, response: list[int]) -> Sample:
    n = len(response)
    return Sample(
        prompt_ids=[1, 13, 2],
        response_ids=response,
        rollout_logprobs=[-1.0] * n,
        loss_mask=[1] * n,
        weight_versions=[0] * n,
        metadata={} if task is None else {"task": task},
    )


def test_each_sample_is_scored_by_its_tasks_teacher(tmp_path):
    paths = {
        name: save_random_model(hf_config(TEACHER_MODEL), tmp_path / name, seed=seed)
        for name, seed in [("a", 1), ("b", 2)]
    }
    started = {name: ServedModel(ServedConfig(path=str(path)), EngineConfig()) for name, path in paths.items()}
    try:
        by_url = ServedModel(ServedConfig(url=started["b"].url()), EngineConfig())  # connect: nothing started
        assert by_url.process is None and by_url.healthy()
        by_url.stop()
        assert started["b"].healthy()
        teacher = Teacher({None: started["a"].url(), "math": started["b"].url()})
        samples = [sample("math", [40, 41, 42]), sample(None, [40, 41, 42]), sample("code", [7])]

        async def score():
            try:
                await teacher.score_group(samples)
                direct = {}
                for name, served in started.items():
                    client = EngineClient(served.url())
                    direct[name] = (await client.score([1, 13, 2, 40, 41, 42], return_routed_experts=False)).logprobs
                    await client.close()
                return direct
            finally:
                await teacher.close()

        direct = asyncio.run(score())
        assert samples[0].teacher_logprobs == direct["b"][2:]  # the response's 3 tokens, task "math"
        assert samples[1].teacher_logprobs == direct["a"][2:]  # no task: the default teacher
        assert samples[0].teacher_logprobs != samples[1].teacher_logprobs
        assert len(samples[2].teacher_logprobs) == 1  # an unlisted task: the default teacher
        assert all(s.metadata["teacher_s"] > 0 for s in samples)
        no_default = Teacher({"math": started["b"].url()})
        with pytest.raises(ValueError, match="no teacher for task 'code'"):
            no_default.client_for(samples[2])
    finally:
        for served in started.values():
            served.stop()
    assert not any(served.healthy() for served in started.values())
