"""The consistency probe's rollout-worker side (`moe_rl.rl.consistency_probe`) on a real embedded
engine: which rows it takes, the batch it builds from the engine's scores, and the skip when the
engine serves another version. The whole probe runs in the RL tests (tests/rl/test_rl_modes.py,
test_rl_lora.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from moe_rl.engine.client import EngineClient
from moe_rl.engine.pool import EnginePool
from moe_rl.engine.process import EmbeddedConfig, launch_embedded
from moe_rl.rl.consistency_probe import ProbeRequest, probe_due, probe_ids, score_rows
from moe_rl.rollout.train_batch import RLBatch
from tests.engine.engine_helpers import run

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)


@pytest.fixture(scope="module")
def engine(qwen3_dir):
    with launch_embedded(EmbeddedConfig(model_path=qwen3_dir, weight_version="0", threads=1)) as engine:
        yield engine


def _batch() -> RLBatch:
    """Six rows: prompts of 3, responses of 2-4 tokens; row 2 untrained (its loss mask 0) and row 5
    padding; row 3 holds token 0 (a real id) inside its response and untrained at its end, where it
    reads as padding."""
    rows = [[5, 6, 7, 8, 9], [5, 6, 7, 1, 2, 3], [5, 6, 7, 4, 4], [9, 8, 7, 6, 0, 3, 0], [1, 2, 3, 4, 5]]
    tokens = torch.zeros(6, 7, dtype=torch.long)
    mask = torch.zeros(6, 7, dtype=torch.long)
    for i, ids in enumerate(rows):
        tokens[i, : len(ids)] = torch.tensor(ids)
        mask[i, 3 : len(ids)] = 0 if i == 2 else 1
    mask[3, 6] = 0
    zeros = torch.zeros(6, 7)
    return RLBatch(tokens=tokens, loss_mask=mask, advantages=zeros, rollout_logprobs=zeros)


def test_the_probe_takes_trained_rows_evenly_up_to_their_last_token():
    batch = _batch()
    # trained rows 0, 1, 3, 4: two of them are rows 0 and 3; row 3 keeps its inner token 0 and ends
    # at its last real token (what follows predicts nothing trained)
    assert probe_ids(batch, 2) == [[5, 6, 7, 8, 9], [9, 8, 7, 6, 0, 3]]
    assert len(probe_ids(batch, 10)) == 4
    assert probe_ids(dataclasses.replace(batch, loss_mask=torch.zeros(6, 7, dtype=torch.long)), 2) == []
    assert [step for step in range(1, 31) if probe_due(10, step)] == [10, 20, 30] and not probe_due(0, 10)


def test_scores_become_the_probe_batch_and_another_version_skips(engine):
    ids = probe_ids(_batch(), 3)

    async def go():
        client = EngineClient(engine.url, num_hidden_layers=3, topk=2)
        pool = EnginePool([client])
        try:
            probe = await score_rows(pool, ids, ProbeRequest(0))
            skipped = await score_rows(pool, ids, ProbeRequest(1))
            alone = await client.score(ids[1])
            return probe, skipped, alone, await score_rows(pool, [], ProbeRequest(0))
        finally:
            await pool.close()

    probe, skipped, alone, empty = run(go())
    assert skipped == "engines served versions [0] where the trainer holds 1" and "no trained" in empty
    lengths = [len(row) for row in ids]
    assert probe.tokens.shape == (3, max(lengths)) and probe.routed_experts.shape == (3, max(lengths), 3, 2)
    for row, length in enumerate(lengths):
        assert probe.tokens[row, :length].tolist() == ids[row]
        assert probe.loss_mask[row].tolist() == [0] + [1] * (length - 1) + [0] * (max(lengths) - length)
    # row 1 scored beside the others equals it scored alone (the same prefill's arithmetic, ~1e-7)
    length = lengths[1]
    assert np.allclose(probe.engine_logprobs[1, 1:length].numpy(), alone.logprobs, atol=1e-5, rtol=0)
    assert np.array_equal(probe.routed_experts[1, : length - 1].numpy(), alone.routed_experts)
    # rows past a sequence's routing hold experts 0..topk-1: no duplicate for a replayed router
    assert (probe.routed_experts[1, length - 1 :] == torch.arange(2)).all()
