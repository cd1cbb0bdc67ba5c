"""Supervised next-token training on the Megatron trainer (smoke run and warm start).

Rank function: every rank of the trainer world runs `run(config)`. Global rank 0 shows the
progress bar and writes metrics; the last step saves a dist checkpoint (model, optimizer, RNG).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from moe_rl.config import DataConfig, RunConfig, dump_config
from moe_rl.metrics import MetricsLogger
from moe_rl.progress import StepProgress
from moe_rl.trainer.checkpoint import save_checkpoint
from moe_rl.trainer.megatron_trainer import MegatronTrainer


def load_batch(data: DataConfig, rows: int, vocab_size: int, seed: int) -> dict[str, torch.Tensor]:
    """A fixed global batch: rows from the JSONL file (cut/padded) or seeded random tokens."""
    if data.path is None:
        generator = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, vocab_size, (rows, data.seq_length), generator=generator)
        mask = torch.ones_like(tokens)
        mask[:, 0] = 0
        return {"tokens": tokens, "loss_mask": mask}
    lines = [json.loads(line) for line in Path(data.path).read_text().splitlines() if line.strip()]
    if len(lines) < rows:
        raise ValueError(f"data.path has {len(lines)} rows; trainer.global_batch_size needs {rows}")
    tokens = torch.zeros(rows, data.seq_length, dtype=torch.long)
    mask = torch.zeros(rows, data.seq_length, dtype=torch.long)
    for row, line in enumerate(lines[:rows]):
        ids = line["input_ids"][: data.seq_length]
        if any(not 0 <= t < vocab_size for t in ids):
            raise ValueError(f"data.path row {row}: token ids must be in [0, {vocab_size})")
        tokens[row, : len(ids)] = torch.tensor(ids)
        mask[row, 1 : len(ids)] = 1
    return {"tokens": tokens, "loss_mask": mask}


def run(config: RunConfig) -> list[float]:
    """Train `config.steps` steps on one fixed batch; returns the loss curve (every rank)."""
    is_logger = dist.get_rank() == 0
    trainer = MegatronTrainer(config.trainer, config.model.load_hf_config(), lora=config.lora)
    batch = load_batch(config.data, config.trainer.global_batch_size, trainer.bridge.vocab_size, config.trainer.seed)
    run_dir = Path(config.output_dir)
    logger = None
    if is_logger:
        run_dir.mkdir(parents=True, exist_ok=True)
        dump_config(config, run_dir / "config.json")
        logger = MetricsLogger(run_dir)
    losses = []
    with StepProgress("train", config.steps, enabled=is_logger) as progress:
        for _ in range(config.steps):
            result = trainer.train_step(batch)
            losses.append(result.loss)
            if logger:
                logger.log(
                    result.step,
                    {"train/loss": result.loss, "train/grad_norm": result.grad_norm, "train/tokens": result.num_tokens},
                )
            progress.advance(f"loss {result.loss:.4f}  grad norm {result.grad_norm:.3f}")
    if config.save_checkpoint:
        save_checkpoint(trainer, run_dir / "checkpoint")
    if logger:
        logger.close()
    return losses
