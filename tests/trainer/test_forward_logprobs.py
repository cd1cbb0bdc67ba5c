"""The trainer's per-token logprobs equal transformers' log-softmax on the same weights, for
every row of the global batch (DP shards and microbatches put back in order), and the entropy a
train step reports equals transformers' entropy over the trained tokens."""

import pytest
import torch
from tiny_qwen3 import hf_config

from parallel.world import spawn

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

LAYOUTS = [
    dict(world_size=4, tp=2, ep=2, sequence_parallel=True),  # DP2 over rows
    dict(world_size=4, pp=2, ep=2),
]


def trainer_logprobs(hf_dir, tokens):
    from moe_rl.config import TrainerConfig
    from moe_rl.trainer.megatron_trainer import MegatronTrainer

    out = []
    for layout in LAYOUTS:
        trainer = MegatronTrainer(TrainerConfig(**layout, micro_batch_size=2, global_batch_size=8), hf_config())
        trainer.load_hf_weights(hf_dir)
        batch = {"tokens": tokens, "loss_mask": torch.ones_like(tokens)}
        out.append((trainer.forward_logprobs(batch), trainer.train_step(batch).sums["entropy"]))
    return out


def test_forward_logprobs_match_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(hf_config(), dtype=torch.float32).eval()
    reference.save_pretrained(tmp_path)
    tokens = torch.randint(0, 256, (8, 15), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = reference(tokens).logits[:, :-1]
    log_probs = torch.log_softmax(logits, -1)
    expected = log_probs.gather(-1, tokens[:, 1:, None])[..., 0]
    expected_entropy = float(-(log_probs.exp() * log_probs).sum())

    per_rank = spawn(trainer_logprobs, 4, str(tmp_path), tokens)
    for rank_results in per_rank:
        for layout, (logprobs, entropy) in zip(LAYOUTS, rank_results):
            assert logprobs.shape == expected.shape, layout
            assert torch.allclose(logprobs, expected, atol=1e-4), (layout, (logprobs - expected).abs().max())
            assert abs(entropy - expected_entropy) < 1e-3 * expected_entropy, (layout, entropy, expected_entropy)
