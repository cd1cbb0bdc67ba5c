"""Multi-token-prediction layers in the trainer (megatron-core's MTP block, on the last of two
pipeline stages, beside its tied copy of the embedding): a DeepSeek-V3 checkpoint with one MTP
layer trains an RL step with `trainer.mtp_loss_weight` 0 (MTP carried along: bit-exact in the
export, which is also the weight-sync stream) and 0.3 (MTP trained, and its loss reaches the main
layers too), with R3 routing replay on the decoder layers."""

from __future__ import annotations

import math

import pytest
import torch

from parallel.world import spawn
from tests.tiny_models import DEEPSEEK_V3, hf_config, save_random_model, with_mtp_layer

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

ROWS, SEQ, PROMPT, MTP = 4, 10, 3, "model.layers.4."


def _step_rank(hf_dir: str, weight: float) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], float]:
    """Import, one RL step (routing replayed), export: ({hf name: (before, after)} on the source
    ranks, the step's MTP loss)."""
    import json
    from pathlib import Path

    from moe_rl.algorithms import AlgorithmConfig
    from moe_rl.config import TrainerConfig
    from moe_rl.rollout.train_batch import RLBatch
    from moe_rl.trainer.megatron_trainer import MegatronTrainer
    from moe_rl.trainer.rl_step import rl_step

    config = TrainerConfig(
        world_size=2, pp=2, global_batch_size=ROWS, micro_batch_size=2, routing_replay=True, mtp_loss_weight=weight
    )
    config.optimizer.lr = 1e-2
    hf = json.loads((Path(hf_dir) / "config.json").read_text())
    trainer = MegatronTrainer(config, hf)
    trainer.load_hf_weights(hf_dir)
    before = {name: tensor.clone() for name, tensor in trainer.export_hf_weights(1 << 20)}
    g = torch.Generator().manual_seed(0)
    mask = torch.zeros(ROWS, SEQ, dtype=torch.long)
    mask[:, PROMPT:] = 1
    layers, topk = hf["num_hidden_layers"], hf["num_experts_per_tok"]
    batch = RLBatch(
        tokens=torch.randint(0, 256, (ROWS, SEQ), generator=g),
        loss_mask=mask,
        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None].expand(ROWS, SEQ).contiguous(),
        rollout_logprobs=torch.full((ROWS, SEQ), -math.log(256)),
        routed_experts=torch.stack(
            [torch.randperm(hf["n_routed_experts"], generator=g)[:topk] for _ in range(ROWS * SEQ * layers)]
        ).view(ROWS, SEQ, layers, topk),
    )
    metrics = rl_step(trainer, batch, AlgorithmConfig())
    assert math.isfinite(metrics["train/loss"])
    after = dict(trainer.export_hf_weights(1 << 20))
    assert set(after) == set(before)
    return {name: (before[name], after[name]) for name in after}, metrics["train/mtp_loss"]


def test_mtp_layers_carried_untrained_or_trained(tmp_path):
    config = hf_config(DEEPSEEK_V3, num_nextn_predict_layers=1)
    hf_dir = save_random_model(config, tmp_path / "hf")
    from safetensors.torch import load_file, save_file

    (file,) = hf_dir.glob("*.safetensors")
    tensors = with_mtp_layer(load_file(file), config.to_dict())  # transformers saves no MTP layer
    save_file(tensors, str(file), metadata={"format": "pt"})

    untrained_ranks, trained_ranks = spawn(_step_rank, 2, str(hf_dir), 0.0), spawn(_step_rank, 2, str(hf_dir), 0.3)
    untrained = {k: v for part, _ in untrained_ranks for k, v in part.items()}
    trained = {k: v for part, _ in trained_ranks for k, v in part.items()}
    # logged from the forward before the update, on every rank: a near-uniform model's ln(vocab)
    losses = {loss for _, loss in untrained_ranks + trained_ranks}
    assert len(losses) == 1 and abs(losses.pop() - math.log(256)) < 0.5, losses
    assert set(untrained) == set(tensors)  # every tensor, the MTP layer's included, exported once
    mtp_own = [n for n in untrained if n.startswith(MTP) and "embed_tokens" not in n and "shared_head.head" not in n]
    for name in mtp_own:
        before, after = untrained[name]
        assert torch.equal(before, tensors[name]) and torch.equal(after, before), name
    moved = [n for n in mtp_own if not torch.equal(*trained[n])]
    assert {MTP + "eh_proj.weight", MTP + "enorm.weight", MTP + "self_attn.o_proj.weight"} <= set(moved), moved
    # the shared embedding and head stay one tensor: their MTP copies move with them
    for main, copy in (
        ("model.embed_tokens.weight", "embed_tokens.weight"),
        ("lm_head.weight", "shared_head.head.weight"),
    ):
        assert torch.equal(trained[main][1], trained[MTP + copy][1]) and not torch.equal(*trained[main])
    # the MTP loss trains the main layers as well: the same step without it lands elsewhere
    assert not torch.equal(
        trained["model.layers.3.self_attn.o_proj.weight"][1], untrained["model.layers.3.self_attn.o_proj.weight"][1]
    )
    assert torch.equal(
        trained["model.layers.3.self_attn.o_proj.weight"][0], untrained["model.layers.3.self_attn.o_proj.weight"][0]
    )
