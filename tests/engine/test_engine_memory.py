"""Memory release/resume on a live embedded engine (SGLang's colocated-RL endpoints, through
`EngineClient`): release frees the weights (the engine reports 0 weight bytes) and refuses
/generate with a clear error; resume re-allocates them but generation stays refused until a full
weight update, after which the engine serves the new weights exactly."""

from __future__ import annotations

import asyncio

import pytest

from moe_rl.engine.client import EngineError
from moe_rl.engine.process import EmbeddedConfig, launch_embedded
from moe_rl.engine.sampling import SamplingParams
from tests.engine.engine_helpers import run, save_tiny_model, wait_for_load, with_client
from tests.engine.test_engine_weights import generate, matches

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)


def test_release_resume_and_reload(qwen3_dir, tmp_path):
    new_dir = save_tiny_model("qwen3_moe", tmp_path / "new", seed=1)

    async def go(client):
        infos = [await client.model_info()]
        await client.generate([1, 2, 3], SamplingParams(max_new_tokens=4))
        with pytest.raises(EngineError, match="tags"):
            await client.release_memory_occupation(["activations"])
        await client.pause_generation("abort")
        await client.release_memory_occupation(["weights", "kv_cache"])
        infos.append(await client.model_info())
        with pytest.raises(EngineError, match="refused.*released"):
            await client.generate([1, 2, 3], SamplingParams(max_new_tokens=4))
        await client.resume_memory_occupation(["weights", "kv_cache"])
        infos.append(await client.model_info())
        with pytest.raises(EngineError, match="reallocated"):
            await client.generate([1, 2, 3], SamplingParams(max_new_tokens=4))
        with pytest.raises(EngineError, match="all .* checkpoint tensors"):  # a relabel is not a reload
            await client.update_weight_version("5")
        await client.update_weights_from_disk(str(new_dir), weight_version="1")
        await client.continue_generation()
        infos.append(await client.model_info())
        return infos, await generate(client)

    with launch_embedded(EmbeddedConfig(model_path=qwen3_dir, weight_version="0", threads=1)) as engine:
        (loaded, released, resumed, reloaded), results = run(with_client(engine.url, go))
    assert loaded["weights_state"] == "loaded" and loaded["weight_bytes"] > 0 and loaded["memory_released"] == []
    assert released["weights_state"] == "released" and released["weight_bytes"] == 0
    assert released["memory_released"] == ["kv_cache", "weights"]
    # resume allocates the checkpoint tensors again (no model yet)
    assert resumed["weights_state"] == "reallocated" and 0 < resumed["weight_bytes"] < loaded["weight_bytes"]
    assert resumed["memory_released"] == []
    # (a rebuilt model shares its unfused tensors with the checkpoint: fewer bytes than at start)
    assert reloaded["weights_state"] == "loaded" and reloaded["weight_bytes"] >= resumed["weight_bytes"]
    assert reloaded["weight_version"] == "1"
    assert all(r.weight_version == 1 for r in results) and matches(new_dir, results)


def test_release_needs_an_idle_engine(qwen3_dir):
    """A request queued or running (generation not paused) keeps the engine busy: refused."""

    async def go(client):
        long = asyncio.create_task(client.generate([5, 6, 7], SamplingParams(max_new_tokens=400, ignore_eos=True)))
        await wait_for_load(
            client.url, lambda load: load["num_running_reqs"] + load["num_waiting_reqs"] == 1, "took the request"
        )  # in the engine; 400 decode steps take far longer
        with pytest.raises(EngineError, match="idle"):
            await client.release_memory_occupation()
        return await long

    with launch_embedded(EmbeddedConfig(model_path=qwen3_dir, weight_version="0", threads=1)) as engine:
        result = run(with_client(engine.url, go))
    assert len(result.output_ids) == 400 and result.finish_reason == "length"
