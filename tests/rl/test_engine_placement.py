"""Where the RL job puts its engine servers (`engine_placement`): a CPU each for embedded engines,
`engines.tp` GPUs each for disaggregated SGLang engines, and, colocated, the GPUs of the
trainer ranks they share, one node per engine. The SGLang run itself needs GPUs (marked `gpu`)."""

from __future__ import annotations

import shutil

import pytest
import torch

from moe_rl.config import EngineConfig
from moe_rl.rl.rollout_actor import engine_placement

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)


def test_embedded_and_disaggregated_sglang_engines():
    assert engine_placement(EngineConfig(count=2), colocate=False) == [({"num_cpus": 1, "num_gpus": 0}, None)] * 2
    sglang = EngineConfig(kind="sglang", count=3, tp=4, ep=4)
    assert engine_placement(sglang, colocate=False) == [({"num_cpus": 1, "num_gpus": 4}, None)] * 3


def test_colocated_sglang_engines_use_their_trainer_ranks_gpus():
    devices = [("10.0.0.1", [str(g)]) for g in range(4)] + [("10.0.0.2", [str(g)]) for g in range(4)]
    placement = engine_placement(EngineConfig(kind="sglang", count=4, tp=2), colocate=True, trainer_devices=devices)
    assert [options["bundle"] for options, _ in placement] == [0, 2, 4, 6]
    assert [gpus for _, gpus in placement] == [["0", "1"], ["2", "3"], ["0", "1"], ["2", "3"]]
    assert all(options["num_gpus"] == 0 and options["num_cpus"] == 0 for options, _ in placement)
    with pytest.raises(ValueError, match="engines.tp=8 trainer GPUs on one node"):  # spans both nodes
        engine_placement(EngineConfig(kind="sglang", count=1, tp=8), colocate=True, trainer_devices=devices)


@pytest.mark.gpu_sglang
@pytest.mark.skipif(
    not torch.cuda.is_available() or shutil.which("nvidia-smi") is None, reason="needs a CUDA GPU and sglang installed"
)
def test_rl_run_with_an_sglang_engine(tmp_path):
    pytest.importorskip("sglang")
    import dataclasses

    from moe_rl.jobs import rl
    from tests.rl.test_rl_modes import tiny_config

    config = dataclasses.replace(
        tiny_config(tmp_path, "fully_async"),
        steps=3,
        engines=EngineConfig(kind="sglang", count=1, mem_fraction_static=0.3),
    )
    summary = rl.run(config)
    assert len(summary["rewards"]) == 3
    ledger = summary["ledger"]
    assert set(ledger["started"]) == set(ledger["delivered"]) | set(ledger["dropped"])
