"""The frozen KL reference on a 2-rank gloo world, under TP2+SP and under EP2, both with R3.

(a) Step 0: the reference (rebuilt from trainer.seed) gives the policy's recomputed logprobs bit
    for bit, with the rollout's routing replayed (an unnatural routing, so replay shows) and
    without; the KL of a train step is exactly 0; the reference forward leaves the policy's
    replay state alone (its replayed logprobs are unchanged after it).
(b) After updates with kl_coef > 0 the KL is > 0, the policy moved, and the reference, exported
    as an HF checkpoint, equals the initial export tensor for tensor; a reference loaded from
    that export (the `ref_model_path` route) gives the same logprobs bit for bit.
"""

import pytest
import torch
from tiny_qwen3 import TINY_QWEN3_MOE, hf_config

from moe_rl.engine.embedded.runner import load_checkpoint_state
from parallel.world import spawn

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

ROWS, SEQ, LAYERS = 8, 16, TINY_QWEN3_MOE["num_hidden_layers"]
EXPERTS, TOPK = TINY_QWEN3_MOE["num_experts"], TINY_QWEN3_MOE["num_experts_per_tok"]
LAYOUTS = [dict(tp=2, sequence_parallel=True), dict(ep=2)]


def make_batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 256, (ROWS, SEQ), generator=generator)
    loss_mask = torch.ones_like(tokens)
    loss_mask[:, :4] = 0  # a 4-token prompt
    b, t, layer = torch.meshgrid(torch.arange(ROWS), torch.arange(SEQ), torch.arange(LAYERS), indexing="ij")
    first = (3 * b + 5 * t + layer) % EXPERTS
    second = (first + 1 + (b + t) % (EXPERTS - 1)) % EXPERTS
    advantages = torch.randn(ROWS, 1, generator=generator).expand(ROWS, SEQ) * loss_mask
    return {
        "tokens": tokens,
        "loss_mask": loss_mask,
        "advantages": advantages.contiguous(),
        "rollout_logprobs": torch.zeros(ROWS, SEQ),
        "routed_experts": torch.stack([first, second], dim=-1).to(torch.int32),
    }


def shifted(logprobs: torch.Tensor) -> torch.Tensor:
    """[B, S-1] trainer logprobs -> [B, S] at the tokens' positions (as the RL step aligns them)."""
    return torch.cat([torch.zeros_like(logprobs[:, :1]), logprobs], dim=1)


def run_layouts(tmp_dir: str):
    from moe_rl.algorithms import AlgorithmConfig, make_policy_loss
    from moe_rl.config import OptimizerConfig, TrainerConfig
    from moe_rl.trainer.megatron_trainer import MegatronTrainer
    from parallel.export import save_hf_checkpoint

    batch = make_batch()
    loss_fn = make_policy_loss(AlgorithmConfig(kl_coef=0.5, kl_estimator="k3"))
    out = []
    for index, layout in enumerate(LAYOUTS):
        config = TrainerConfig(
            world_size=2,
            **layout,
            routing_replay=True,
            micro_batch_size=2,
            global_batch_size=ROWS,
            optimizer=OptimizerConfig(lr=1e-2),
        )
        trainer = MegatronTrainer(config, hf_config())
        trainer.build_reference()
        result = {}
        policy_replay = trainer.forward_logprobs(batch)
        ref_replay = trainer.reference_logprobs(batch)
        result["replay_equal"] = torch.equal(policy_replay, ref_replay)
        result["natural_equal"] = torch.equal(
            trainer.forward_logprobs(batch, replay=False), trainer.reference_logprobs(batch, replay=False)
        )
        result["replay_shows"] = not torch.equal(policy_replay, trainer.forward_logprobs(batch, replay=False))
        result["policy_replay_undisturbed"] = torch.equal(trainer.forward_logprobs(batch), policy_replay)
        initial = f"{tmp_dir}/initial_{index}"
        trainer.save_hf_checkpoint(initial, hf_config().to_dict())

        kls = []
        for _ in range(4):
            old, ref = trainer.forward_logprobs(batch), trainer.reference_logprobs(batch)
            step = {
                **batch,
                "old_logprobs": shifted(old),
                "ref_logprobs": shifted(ref),
                "rollout_logprobs": shifted(old),
            }
            kls.append(trainer.train_step(step, loss_fn).sums["kl"])
        result["kls"] = kls
        save_hf_checkpoint(
            trainer.reference.model, trainer.bridge, f"{tmp_dir}/reference_{index}", hf_config().to_dict()
        )
        trainer.save_hf_checkpoint(f"{tmp_dir}/policy_{index}", hf_config().to_dict())
        seeded = trainer.reference_logprobs(batch)
        trainer.build_reference(initial)  # the ref_model_path route
        result["loaded_equal"] = torch.equal(trainer.reference_logprobs(batch), seeded)
        result["frozen"] = all(not p.requires_grad for p in trainer.reference.model.parameters())
        out.append(result)
    return out


def test_reference_is_the_frozen_initial_policy(tmp_path):
    per_rank = spawn(run_layouts, 2, str(tmp_path))
    for rank_results in per_rank:
        for index, (layout, result) in enumerate(zip(LAYOUTS, rank_results)):
            assert result["replay_equal"] and result["natural_equal"], layout
            assert result["replay_shows"] and result["policy_replay_undisturbed"], layout
            assert result["kls"][0] == 0.0, (layout, result["kls"])
            assert all(kl > 0 for kl in result["kls"][1:]), (layout, result["kls"])
            assert result["loaded_equal"] and result["frozen"], layout
    for index, layout in enumerate(LAYOUTS):
        initial = load_checkpoint_state(tmp_path / f"initial_{index}")
        reference = load_checkpoint_state(tmp_path / f"reference_{index}")
        policy = load_checkpoint_state(tmp_path / f"policy_{index}")
        assert initial.keys() == reference.keys() == policy.keys()
        assert all(torch.equal(initial[name], reference[name]) for name in initial), layout
        assert not all(torch.equal(initial[name], policy[name]) for name in initial), layout


def run_lora(_):
    """A LoRA run's reference: the policy with its adapters off, no second model."""
    from moe_rl.algorithms import AlgorithmConfig, make_policy_loss
    from moe_rl.config import OptimizerConfig, TrainerConfig
    from moe_rl.trainer.megatron_trainer import MegatronTrainer
    from parallel.lora import LoRAConfig

    batch = make_batch()
    loss_fn = make_policy_loss(AlgorithmConfig(kl_coef=0.5, kl_estimator="k3"))
    config = TrainerConfig(
        world_size=2,
        tp=2,
        sequence_parallel=True,
        routing_replay=True,
        micro_batch_size=2,
        global_batch_size=ROWS,
        optimizer=OptimizerConfig(lr=1e-2),
    )
    trainer = MegatronTrainer(config, hf_config(), lora=LoRAConfig(rank=4))
    trainer.build_reference("/nowhere")  # with LoRA the path is not read: the base is in the policy
    initial = trainer.reference_logprobs(batch)
    result = {
        "same_model": trainer.reference.model is trainer.model,
        "step0": torch.equal(initial, trainer.forward_logprobs(batch)),
    }
    kls = []
    for _ in range(3):
        old, ref = trainer.forward_logprobs(batch), trainer.reference_logprobs(batch)
        step = {**batch, "old_logprobs": shifted(old), "ref_logprobs": shifted(ref), "rollout_logprobs": shifted(old)}
        kls.append(trainer.train_step(step, loss_fn).sums["kl"])
    result["kls"] = kls
    result["reference_unchanged"] = torch.equal(trainer.reference_logprobs(batch), initial)
    result["policy_moved"] = not torch.equal(trainer.forward_logprobs(batch), initial)
    return result


def test_lora_reference_is_the_policy_with_adapters_off():
    for result in spawn(run_lora, 2, None):
        assert result["same_model"] and result["step0"]
        assert result["kls"][0] == 0.0 and all(kl > 0 for kl in result["kls"][1:]), result["kls"]
        assert result["reference_unchanged"] and result["policy_moved"]
