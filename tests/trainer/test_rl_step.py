"""The RL step and the weight sync as the trainer ranks run them (`moe_rl.trainer.rl_step`,
`moe_rl.trainer.weight_sync`), without Ray: two gloo ranks (EP2) under `parallel.world.spawn`,
and a real embedded engine for the sync."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from moe_rl.rollout.train_batch import RLBatch
from parallel.world import spawn
from tests.tiny_models import QWEN3_MOE_SMALL, hf_config

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

ROWS, SEQ, PROMPT = 4, 10, 3


def _trainer(**trainer):
    from moe_rl.config import TrainerConfig
    from moe_rl.trainer.megatron_trainer import MegatronTrainer

    trainer = {"ep": 2, **trainer}
    config = TrainerConfig(world_size=2, global_batch_size=ROWS, micro_batch_size=1, **trainer)
    return MegatronTrainer(config, hf_config(QWEN3_MOE_SMALL))


def _batch() -> RLBatch:
    generator = torch.Generator().manual_seed(0)
    mask = torch.zeros(ROWS, SEQ, dtype=torch.long)
    mask[:, PROMPT:] = 1
    return RLBatch(
        tokens=torch.randint(0, 256, (ROWS, SEQ), generator=generator),
        loss_mask=mask,
        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None].expand(ROWS, SEQ).contiguous(),
        rollout_logprobs=torch.full((ROWS, SEQ), -math.log(256)),
    )


def _step_rank():
    from moe_rl.algorithms import AlgorithmConfig
    from moe_rl.trainer.rl_step import rl_step

    algorithm = AlgorithmConfig(num_mini_batches=2)
    trainer = _trainer()
    start = trainer.forward_logprobs(_batch().tensors())
    seen = []  # what a forward inside the step sees, where the consistency probe compares
    metrics = rl_step(
        trainer, _batch(), algorithm, before_update=lambda: seen.append(trainer.forward_logprobs(_batch().tensors()))
    )
    end = trainer.forward_logprobs(_batch().tensors())
    plain = _trainer()  # the same step without the hook
    unhooked = rl_step(plain, _batch(), algorithm)
    hook = {"calls": len(seen), "saw_start": torch.equal(seen[0], start), "end_moved": not torch.equal(end, start)}
    same_update = torch.equal(end, plain.forward_logprobs(_batch().tensors()))
    return metrics, trainer.step, hook, same_update, _untimed(unhooked)


def _untimed(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith("time/")}


def test_rl_step_on_two_ranks():
    """Old logprobs once, two PPO mini-batches, the same metrics on every rank. `before_update`
    runs once, on the weights the step began with, and a forward there leaves the update as it was."""
    (metrics, steps, hook, same_update, unhooked), (other, other_steps, *_) = spawn(_step_rank, 2)
    untimed = _untimed(metrics)
    assert untimed == _untimed(other) == unhooked
    assert hook == {"calls": 1, "saw_start": True, "end_moved": True} and same_update
    assert steps == other_steps == 2
    for key in (
        "offpolicy/logprob_diff_mean",
        "offpolicy/logprob_diff_abs",
        "policy/clip_fraction",
        "policy/ratio",
        "train/grad_norm",
        "time/old_logprobs_s",
        "time/train_step_s",
    ):
        assert key in metrics, key
    assert metrics["train/tokens"] == ROWS * (SEQ - PROMPT) and math.isfinite(metrics["train/loss"])
    assert metrics["offpolicy/logprob_diff_mean"] < 0.5  # a fresh tiny model is near uniform
    # the cross-version gaps moved under offpolicy/ (docs/algorithm.md): the old names are gone
    assert not [k for k in metrics if k.startswith("consistency/") or k == "policy/logprob_diff_abs"]


def _one_update_rank():
    import dataclasses

    from moe_rl.algorithms import AlgorithmConfig, make_policy_loss
    from moe_rl.trainer.rl_step import rl_step

    algorithm = AlgorithmConfig(num_mini_batches=1)
    batch = _batch()
    skipping = _trainer()
    metrics = rl_step(skipping, batch, algorithm)
    # the same update with the old logprobs from a pass of their own
    recomputing = _trainer()
    old = recomputing.forward_logprobs(batch.tensors())
    batch = dataclasses.replace(batch, old_logprobs=torch.cat([torch.zeros_like(old[:, :1]), old], dim=1))
    result = recomputing.train_step(batch.tensors(), make_policy_loss(algorithm))
    mask = batch.loss_mask[:, 1:].bool()
    diff = (old - batch.rollout_logprobs[:, 1:]).abs()[mask]
    params = [
        (mine, theirs) for mine, theirs in zip(skipping.model.parameters(), recomputing.model.parameters(), strict=True)
    ]
    return metrics, result, [float(diff.mean()), float(diff.max())], max((a - b).abs().max().item() for a, b in params)


def test_one_update_takes_its_old_logprobs_from_its_own_forward():
    """num_mini_batches 1: no old-logprob pass; the update and the off-policy gap equal those
    of the same step with the old logprobs recomputed first (the forward is the same function)."""
    for metrics, result, (diff_mean, diff_max), weight_gap in spawn(_one_update_rank, 2):
        assert "time/old_logprobs_s" not in metrics
        assert metrics["train/loss"] == pytest.approx(result.loss, rel=1e-6)
        assert metrics["train/grad_norm"] == pytest.approx(result.grad_norm, rel=1e-6)
        assert metrics["policy/ratio"] == 1.0 and metrics["policy/clip_fraction"] == 0.0
        assert metrics["offpolicy/logprob_diff_mean"] == pytest.approx(diff_mean, rel=1e-6)
        assert metrics["offpolicy/logprob_diff_max"] == pytest.approx(diff_max, rel=1e-6)
        assert weight_gap < 1e-6


def test_the_routing_off_forward_runs_every_n_steps():
    """trainer.no_replay_forward_every: steps N, 2N, ...; 0 never; nothing without R3."""
    from moe_rl.config import TrainerConfig
    from moe_rl.trainer.rl_step import no_replay_forward_due

    def due(every, replay=True):
        config = TrainerConfig(routing_replay=replay, no_replay_forward_every=every)
        return [step for step in range(1, 7) if no_replay_forward_due(config, step)]

    assert due(1) == [1, 2, 3, 4, 5, 6] and due(3) == [3, 6] and due(0) == [] and due(1, replay=False) == []
    with pytest.raises(ValueError, match="no_replay_forward_every"):
        TrainerConfig(no_replay_forward_every=-1)


def _sync_rank(url: str, pp: int = 1, relays: int = 0):
    import torch.distributed as dist

    from moe_rl.trainer.weight_sync import ConnectRequest, SyncRequest, WeightSync
    from sync.config import SyncConfig

    trainer = _trainer(pp=pp, ep=1) if pp > 1 else _trainer()
    weight_sync = WeightSync(trainer, dist.get_rank(), 2)
    weight_sync.connect(
        ConnectRequest((url,), SyncConfig(bucket_bytes=64 << 10, timeout_s=60, relays=relays), "embedded", version=0)
    )
    try:
        result = weight_sync.sync(SyncRequest(1, 16 << 10))
        again = weight_sync.sync(SyncRequest(1, 16 << 10))  # the committed version again: nothing to send
    finally:
        weight_sync.close()
    return result.engines, again.engines


@pytest.mark.parametrize("pp, relays", [(1, 0), (2, 0), (1, 1)], ids=["ep2", "pp2-stage-groups", "ep2-relay"])
def test_weight_sync_commits_a_version_on_an_embedded_engine(tmp_path, pp, relays):
    """PP2: each stage's source sends its layers over its own group, which the engine joins too;
    a relay: the other rank joins the group behind the source (the engine at rank_offset 2)."""
    from transformers import AutoModelForCausalLM

    from moe_rl.engine.client import EngineClient
    from moe_rl.engine.process import EmbeddedConfig, launch_embedded

    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(hf_config(QWEN3_MOE_SMALL)).save_pretrained(tmp_path / "hf")
    with launch_embedded(EmbeddedConfig(model_path=tmp_path / "hf", weight_version="0", threads=1)) as engine:
        per_rank = spawn(_sync_rank, 2, engine.url, pp, relays)

        async def info():
            client = EngineClient(engine.url)
            try:
                return await client.model_info()
            finally:
                await client.close()

        served = asyncio.run(info())["weight_version"]
    committed = [engines for engines, _ in per_rank if engines]
    assert committed == [["engine-0"]]  # the sync source reports it; the other rank holds no sender
    assert all(again == [] for _, again in per_rank) and served == "1"
