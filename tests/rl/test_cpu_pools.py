"""`cpu_pools`: the section's validation, and pinning applied for real: an embedded engine launched
on a core reports exactly that core, and in an RL cluster the trainer rank, the engine and the rollout
worker report the cores their pools gave them (the processes' own affinity, read back), while the
driver runs on the trainer's cores until the cluster closes."""

from __future__ import annotations

import contextlib
import json
import os

import pytest

from moe_rl.config import from_dict
from moe_rl.cpu_pools import CpuPoolsConfig, process_cores

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

CORES = sorted(os.sched_getaffinity(0))
two_cores = pytest.mark.skipif(len(CORES) < 2, reason="pinning to disjoint pools needs >= 2 cores")


def scheduling_policies(pid: int) -> set[int]:
    """The scheduling policies of the process's threads (one that exits meanwhile is skipped)."""
    policies = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            policies.add(os.sched_getscheduler(int(tid)))
    return policies


def test_pools_validation():
    first = CORES[0]
    with pytest.raises(ValueError, match=r"cpu_pools.engines\[0\]=\[4096\]: cores \[4096\] are not available"):
        CpuPoolsConfig(trainer=[first], engines=[[4096]])
    with pytest.raises(ValueError, match=r"cpu_pools.engines\[0\] and cpu_pools.trainer both hold core"):
        CpuPoolsConfig(trainer=[first], engines=[[first]])
    assert CpuPoolsConfig(trainer=[first], engines=[[first]], allow_overlap=True).rollout_cores == [first]
    with pytest.raises(ValueError, match="listed twice"):
        CpuPoolsConfig(trainer=[first, first], engines=[[first]], allow_overlap=True)
    with pytest.raises(ValueError, match=r"cpu_pools.trainer\[1\]=\[\]: give it at least one core"):
        CpuPoolsConfig(trainer=[[first], []], engines=[[first]], allow_overlap=True)
    with pytest.raises(ValueError, match="set cpu_pools.trainer"):
        CpuPoolsConfig(trainer=[], engines=[])
    # from YAML: a flat list is shared by the ranks, nested lists are per rank
    pools = from_dict(CpuPoolsConfig, {"trainer": [first], "engines": [[first]], "allow_overlap": True})
    assert pools.shared_trainer and pools.trainer_cores(2) == [([first], 1), ([first], 1)]
    pools = from_dict(CpuPoolsConfig, {"trainer": [[first], [first]], "engines": [[first]], "allow_overlap": True})
    assert not pools.shared_trainer and pools.trainer_cores(2) == [([first], 1), ([first], 1)]
    with pytest.raises(ValueError, match=r"cpu_pools.trainer=\['a'\]: expected list\[int\] or list\[list\[int\]\]"):
        from_dict(CpuPoolsConfig, {"trainer": ["a"], "engines": [[first]]}, prefix="cpu_pools.")


def test_pools_against_the_run(tmp_path):
    import dataclasses

    from tests.rl.test_rl_modes import tiny_config

    first = CORES[0]
    pools = CpuPoolsConfig(trainer=[[first]], engines=[[first], [first]], allow_overlap=True)
    with pytest.raises(ValueError, match=r"cpu_pools.trainer has 1 lists but trainer.world_size=2"):
        pools.check(world_size=2, engine_count=2, engine_kind="embedded")
    with pytest.raises(ValueError, match=r"cpu_pools.engines has 2 lists but engines.count=1"):
        pools.check(world_size=1, engine_count=1, engine_kind="embedded")
    with pytest.raises(ValueError, match="only embedded"):
        pools.check(world_size=1, engine_count=2, engine_kind="sglang")
    config = tiny_config(tmp_path, "sync")  # trainer.world_size 2, one engine
    assert config.cpu_pools is None  # the default: no pinning
    with pytest.raises(ValueError, match=r"cpu_pools.trainer has 1 lists but trainer.world_size=2"):
        dataclasses.replace(config, cpu_pools=CpuPoolsConfig(trainer=[[first]], engines=[[first]], allow_overlap=True))
    shared = dataclasses.replace(
        config, cpu_pools=CpuPoolsConfig(trainer=[first], engines=[[first]], allow_overlap=True)
    )
    assert shared.cpu_pools.trainer_cores(2) == [([first], 1)] * 2
    assert shared.cpu_pools.driver_cores == [first]  # the driver runs on the trainer's cores
    per_rank = CpuPoolsConfig(trainer=[[CORES[-1]], [first]], engines=[[first]], allow_overlap=True)
    assert per_rank.driver_cores == sorted({first, CORES[-1]})  # every rank's


@two_cores
def test_embedded_engine_runs_on_the_cores_it_was_given(tmp_path):
    from moe_rl.engine.process import EmbeddedConfig, launch_embedded
    from tests.engine.engine_helpers import save_tiny_model

    model = save_tiny_model("qwen3_moe", tmp_path / "model")
    with launch_embedded(EmbeddedConfig(model_path=model, cpus=[CORES[-1]])) as engine:
        assert process_cores(engine.process.pid) == [CORES[-1]]
        status = open(f"/proc/{engine.process.pid}/status").read()
        assert f"Cpus_allowed_list:\t{CORES[-1]}\n" in status
        # every thread of the engine (torch's pool included) is pinned, not just the main one
        tids = os.listdir(f"/proc/{engine.process.pid}/task")
        assert {tuple(sorted(os.sched_getaffinity(int(t)))) for t in tids} == {(CORES[-1],)}


@two_cores
def test_rl_cluster_pins_trainer_engine_and_rollout_worker(tmp_path):
    import dataclasses

    import ray

    from moe_rl.algorithms import AlgorithmConfig
    from moe_rl.config import EngineConfig, TrainerConfig
    from moe_rl.rl.cluster import RLCluster
    from moe_rl.rl.rollout_actor import BatchRequest
    from tests.rl.test_rl_modes import tiny_config

    base = tiny_config(tmp_path, "fully_async")
    pools = CpuPoolsConfig(trainer=[CORES[0]], engines=[CORES[1:]])
    config = dataclasses.replace(
        base,
        trainer=TrainerConfig(micro_batch_size=4, global_batch_size=8),
        engines=EngineConfig(count=1),
        cpu_pools=pools,
    )
    cluster = RLCluster(config, tmp_path)
    try:
        assert cluster.trainer.cpus() == [{"cores": [CORES[0]], "threads": 1}]
        pid = ray.get(cluster.engines[0].pid.remote())
        assert process_cores(pid) == CORES[1:]
        assert ray.get(cluster.rollout.cpus.remote()) == CORES[1:]
        # the rollout worker's threads, as SCHED_BATCH, wait for the engine's core instead of taking it
        worker = ray.get(cluster.rollout.__ray_call__.remote(lambda _: os.getpid()))
        assert scheduling_policies(worker) == {os.SCHED_BATCH} and scheduling_policies(pid) == {os.SCHED_OTHER}
        # the driver, every thread of it, runs on the trainer's cores while the cluster lives
        tids = os.listdir("/proc/self/task")
        assert {tuple(sorted(os.sched_getaffinity(int(t)))) for t in tids} == {(CORES[0],)}
        batch = cluster.get_batch(cluster.ask_batch(BatchRequest(1, 0, AlgorithmConfig(), row_multiple=8)))
        assert len(batch.info.group_ids) == 1  # and generation works on them
        recorded = json.loads((tmp_path / "cpu_pools.json").read_text())
        assert recorded == {
            "trainer_ranks": [{"cores": [CORES[0]], "threads": 1}],
            "engines": [CORES[1:]],
            "rollout_worker": CORES[1:],
        }
    finally:
        cluster.close()
    assert os.sched_getaffinity(0) == set(CORES)  # close() gives the driver its cores back


def test_bench_async_pools_and_ideal():
    from moe_rl.bench.asynchrony import _percent, _ratios, _show, _spread, overlap_ideal, pool_overrides

    assert pool_overrides([0, 1]) == [
        "trainer.world_size=1",
        "trainer.ep=1",
        "engines.count=1",
        "cpu_pools={trainer: [0], engines: [[1]]}",
    ]
    assert pool_overrides([0, 1, 2, 3])[-1] == "cpu_pools={trainer: [0, 1], engines: [[2, 3]]}"
    assert overlap_ideal({"mean_trainer_wait_s": 0.5, "mean_step_s": 1.0})["ideal"] == 2.0  # balanced
    assert overlap_ideal({"mean_trainer_wait_s": 0.1, "mean_step_s": 0.5})["ideal"] == pytest.approx(1.25)
    # gen 0.1 / 0.3 and train 0.3 / 0.1 a step: balanced on average (2x), but three of the four
    # pairings last 0.3 s: a lockstep step averages 0.25 s, so 0.4 / 0.25
    spread = {"mean_trainer_wait_s": 0.2, "mean_step_s": 0.4, "trainer_wait_s": [0.1, 0.3], "step_s": [0.4, 0.4]}
    assert overlap_ideal(spread)["ideal"] == pytest.approx(2.0)
    assert overlap_ideal(spread)["lockstep_ideal"] == pytest.approx(1.6)
    run = lambda train_s, wait_s, step_s, drain_s=0.0: {  # noqa: E731
        "train_s": train_s,
        "mean_trainer_wait_s": wait_s,
        "mean_step_s": step_s,
        "mean_drain_s": drain_s,
        "generated_tokens_per_s": 100 / train_s,
        "steps_per_s": 10 / train_s,
    }
    runs = {
        "balanced_sync": run(10, 0.5, 1),
        "balanced_fully_async": run(6, 0.1, 0.6),
        "unbalanced_sync": run(5, 0.1, 0.5),
        "unbalanced_fully_async": run(5, 0, 0.5),
        "long_tail_drain": run(8, 0, 0.8, 0.2),
        "long_tail_partial": run(6, 0.1, 0.6),
    }
    faster = _ratios({**runs, "balanced_fully_async": run(5, 0.1, 0.5)})
    balanced = _spread([r["balanced"] for r in (_ratios(runs), faster, _ratios(runs))])
    assert _show(balanced, "speedup") == "1.67x (1.67-2.00)" and balanced["ideal"] == 2.0  # median, range
    assert _percent(balanced, "of_ideal") == "83% (83-100%)"
    assert _ratios(runs)["long_tail"]["ideal_steps_per_s"] == pytest.approx(0.8 / 0.6)
