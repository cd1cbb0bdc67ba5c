"""Router controls (`trainer.moe`, `parallel.router`) on real trainer ranks (EP2, gloo), R3 on:
a frozen router's weights and expert biases are bit-equal after RL steps, in the trainer and in the
HF checkpoint it writes, and have no optimizer state; an expert-bias update rate of 0 leaves the
biases as loaded while a non-zero rate moves each by exactly rate x sign(mean - its token count);
a load-balancing loss changes the routers' gradient."""

from __future__ import annotations

import math

import pytest
import torch

from parallel.world import spawn
from tests.tiny_models import DEEPSEEK_V3, GLM4_MOE, MIXTRAL, QWEN3_MOE, hf_config, save_random_model

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

ROWS, SEQ, PROMPT = 4, 10, 3


def _batch(hf: dict):
    """An RL batch with random distinct routed experts for every token and layer; row 1 ends early
    (its last 3 inputs predict padding: R3 replays experts 0..topk-1 there)."""
    from moe_rl.rollout.train_batch import RLBatch
    from parallel.bridges import bridge_for

    g = torch.Generator().manual_seed(0)
    mask = torch.zeros(ROWS, SEQ, dtype=torch.long)
    mask[:, PROMPT:] = 1
    mask[1, SEQ - 3 :] = 0
    layers, topk = hf["num_hidden_layers"], hf["num_experts_per_tok"]
    experts = bridge_for(hf).num_experts
    return RLBatch(
        tokens=torch.randint(0, 256, (ROWS, SEQ), generator=g),
        loss_mask=mask,
        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None].expand(ROWS, SEQ).contiguous(),
        rollout_logprobs=torch.full((ROWS, SEQ), -math.log(256)),
        routed_experts=torch.stack(
            [torch.randperm(experts, generator=g)[:topk] for _ in range(ROWS * SEQ * layers)]
        ).view(ROWS, SEQ, layers, topk),
    )


def _router_state(trainer) -> dict[str, torch.Tensor]:
    """{"{HF layer}.weight" / "{HF layer}.expert_bias": tensor} of this rank's routers."""
    from megatron.core.transformer.moe.router import Router

    state = {}
    for router in (m for m in trainer.gpt_model.modules() if isinstance(m, Router)):
        state[f"{router.layer_number - 1}.weight"] = router.weight.detach().clone()
        if router.expert_bias is not None:
            state[f"{router.layer_number - 1}.expert_bias"] = router.expert_bias.clone()
    return state


def _optimizer_params(trainer) -> set[int]:
    optimizers = getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])
    return {id(p) for o in optimizers for group in o.optimizer.param_groups for p in group["params"]}


def _train_rank(hf_dir: str, moe: dict, steps: int, out_dir: str | None, layout: dict | None = None):
    """Load `hf_dir`, `steps` RL steps with `trainer.moe` = `moe` (layout: EP2 on 2 ranks unless
    given); (router state before, after, whether a router parameter is trainable or in the
    optimizer, whether attention moved)."""
    import json
    from pathlib import Path

    from moe_rl.algorithms import AlgorithmConfig
    from moe_rl.config import MoEConfig, TrainerConfig
    from moe_rl.trainer.megatron_trainer import MegatronTrainer
    from moe_rl.trainer.rl_step import rl_step

    layout = layout or dict(world_size=2, ep=2)
    config = TrainerConfig(
        **layout, global_batch_size=ROWS, micro_batch_size=2, routing_replay=True, moe=MoEConfig(**moe)
    )
    config.optimizer.lr = 1e-2
    hf = json.loads((Path(hf_dir) / "config.json").read_text())
    trainer = MegatronTrainer(config, hf)
    trainer.load_hf_weights(hf_dir)
    before = _router_state(trainer)
    attention = next(p for n, p in trainer.gpt_model.named_parameters() if "self_attention.linear_proj" in n)
    attention_before = attention.detach().clone()
    routers = [p for name, p in trainer.gpt_model.named_parameters() if ".router." in name]
    optimized = _optimizer_params(trainer)
    batch = _batch(hf)
    for step in range(1, steps + 1):
        assert math.isfinite(rl_step(trainer, batch, AlgorithmConfig(), step=step)["train/loss"])
    if out_dir is not None:
        trainer.save_hf_checkpoint(out_dir, hf)
    trainable = any(p.requires_grad or id(p) in optimized for p in routers)
    return before, _router_state(trainer), trainable, not torch.equal(attention, attention_before)


def _checkpoint(tmp_path, base: dict):
    """A random HF checkpoint of `base`; DeepSeek-V3's expert biases set to random values (a fresh
    model's are zeros, which hide a bias that moved and came back)."""
    from safetensors.torch import load_file, save_file

    hf_dir = save_random_model(hf_config(base), tmp_path / "hf")
    (file,) = hf_dir.glob("*.safetensors")
    tensors = load_file(file)
    g = torch.Generator().manual_seed(1)
    for name in [n for n in tensors if n.endswith("e_score_correction_bias")]:
        tensors[name] = torch.randn(tensors[name].shape, generator=g) * 0.1
    save_file(tensors, str(file), metadata={"format": "pt"})
    return hf_dir, tensors


@pytest.mark.parametrize("base", [DEEPSEEK_V3, QWEN3_MOE], ids=["deepseek_v3", "qwen3_moe"])
def test_a_frozen_router_stays_bit_equal_in_the_trainer_and_the_hf_checkpoint(tmp_path, base):
    from safetensors.torch import load_file

    hf_dir, loaded = _checkpoint(tmp_path, base)
    ranks = spawn(_train_rank, 2, str(hf_dir), {"freeze_router": True}, 3, str(tmp_path / "out"))
    for before, after, trainable, attention_moved in ranks:
        assert before.keys() == after.keys() and before
        for name in before:
            assert torch.equal(before[name], after[name]), name
        assert not trainable and attention_moved  # the rest of the model trained
    saved = {k: v for file in (tmp_path / "out").glob("*.safetensors") for k, v in load_file(file).items()}
    gates = [name for name in loaded if ".mlp.gate." in name]
    suffixes = {name.rsplit(".", 1)[1] for name in gates}
    assert suffixes == ({"weight", "e_score_correction_bias"} if base is DEEPSEEK_V3 else {"weight"})
    for name in gates:
        assert torch.equal(saved[name], loaded[name]), name
    moved = "model.layers.1.self_attn.o_proj.weight"
    assert not torch.equal(saved[moved], loaded[moved])


@pytest.mark.parametrize(
    "layout",
    [dict(world_size=2, ep=2), dict(world_size=4, tp=2, pp=2, sequence_parallel=True), dict(world_size=2, cp=2, ep=2)],
    ids=["ep2", "tp2-pp2", "cp2-ep2"],  # under CP each rank counts its chunks' tokens, padding masked per chunk
)
def test_expert_bias_update_rate_and_load_balancing_loss(tmp_path, layout):
    from moe_rl.trainer.routing_replay import real_input_rows

    hf_dir, _ = _checkpoint(tmp_path, DEEPSEEK_V3)
    rate, world = 0.01, layout["world_size"]
    kept_ranks = spawn(_train_rank, world, str(hf_dir), {}, 1, None, layout)
    moved_ranks = spawn(
        _train_rank, world, str(hf_dir), {"router_bias_update_rate": rate, "aux_loss_coeff": 0.1}, 1, None, layout
    )
    # each router lives on one pipeline stage: the stages' states together
    kept = {k: v for before, _, _, _ in kept_ranks for k, v in before.items()}
    kept_after = {k: v for _, after, _, _ in kept_ranks for k, v in after.items()}
    moved = {k: v for before, _, _, _ in moved_ranks for k, v in before.items()}
    moved_after = {k: v for _, after, _, _ in moved_ranks for k, v in after.items()}
    assert all(trainable for _, _, trainable, _ in kept_ranks)
    biases = [name for name in kept if name.endswith("expert_bias")]
    weights = [name for name in kept if name.endswith("weight")]
    assert len(biases) == len(weights) == 3  # layers 1-3 (layer 0 dense)
    # rate 0: the biases stay as loaded while the router weights train
    for name in biases:
        assert torch.equal(kept[name], kept_after[name]), name
    for name in weights:
        assert not torch.equal(kept[name], kept_after[name]), name
    # rate > 0: one step moves each bias by rate x sign(mean - the tokens routed to it): the replayed
    # routing of the batch's real inputs (every rank's), not the experts R3 fills padding rows with
    batch = _batch(DEEPSEEK_V3)
    real = real_input_rows(batch.loss_mask)
    assert not real.all()
    for name in biases:
        routed = batch.routed_experts[:, :-1, int(name.split(".")[0])][real]
        counts = torch.bincount(routed.flatten(), minlength=DEEPSEEK_V3["n_routed_experts"]).float()
        expected = moved[name] + torch.sign(counts.mean() - counts) * rate
        assert torch.equal(moved_after[name], expected), name
    # the load-balancing loss (DeepSeek-V3's sequence-level one) adds to the routers' gradient
    for name in weights:
        assert not torch.equal(moved_after[name], kept_after[name]), name


@pytest.mark.parametrize(
    "base, kind",
    [(DEEPSEEK_V3, "seq_aux_loss"), (GLM4_MOE, "seq_aux_loss"), (QWEN3_MOE, "aux_loss"), (MIXTRAL, "aux_loss")],
    ids=["deepseek_v3", "glm4_moe", "qwen3_moe", "mixtral"],
)
def test_router_settings_reach_the_transformer_config(base, kind):
    from parallel import cpu_compat
    from parallel.bridges import bridge_for
    from parallel.layout import ParallelLayout
    from parallel.router import RouterTraining

    cpu_compat.apply()
    bridge, layout = bridge_for(hf_config(base)), ParallelLayout(world_size=1)
    default = bridge.transformer_config(layout)
    assert (default.moe_router_load_balancing_type, default.moe_aux_loss_coeff) == ("none", 0.0)
    config = bridge.transformer_config(layout, RouterTraining(aux_loss_coeff=0.01, bias_update_rate=0.0))
    assert (config.moe_router_load_balancing_type, config.moe_aux_loss_coeff) == (kind, 0.01)
    if bridge.has_expert_bias:
        assert config.moe_router_bias_update_rate == 0.0
    else:
        with pytest.raises(ValueError, match="without an expert bias"):
            bridge.transformer_config(layout, RouterTraining(bias_update_rate=0.01))
