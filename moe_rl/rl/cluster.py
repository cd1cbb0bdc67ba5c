"""`RLCluster`: every process of an RL run, placed and owned by Ray.

Start-up, in order:
  1. `init_ray`: a local Ray with this machine's CPUs (GPUs), or the cluster at RAY_ADDRESS;
  2. the trainer world (`TrainerGroup`: a placement group, one actor per rank, rank 0's
     rendezvous) builds the policy (random init, or loaded from `model.path`);
  3. the trainer writes version 0 as an HF checkpoint (`initial_hf/`), so engines and trainer
     start from identical weights (on resume: loads the run checkpoint first and writes version N,
     which the engines announce as their weight version);
  4. `engines.count` `EngineServer` actors each start an engine server on that checkpoint;
  5. the trainer's sync source joins the engines' weight-update group (`WeightSender`);
  6. the `RolloutWorker` actor starts generating.
`close()` undoes them in reverse and returns the rollout ledger.
"""

from __future__ import annotations

from pathlib import Path

import ray
import torch

from moe_rl.config import RunConfig
from moe_rl.rl.ray_init import init_ray
from moe_rl.rl.rollout_actor import EngineServer, RolloutWorker
from moe_rl.rl.trainer_group import TrainerGroup


class RLCluster:
    def __init__(self, config: RunConfig, run_dir: Path, restore: dict | None = None):
        self.config, self.run_dir, self.restore = config, run_dir, restore
        self.trainer = self.rollout = None
        self.engines: list = []
        use_gpus = torch.cuda.is_available()
        world, engines = config.trainer.world_size, config.engines.count
        if not ray.is_initialized():
            # Local: one logical CPU per trainer rank, engine and the rollout actor (they time-share
            # cores). With RAY_ADDRESS set (SLURM), the running cluster's resources are used.
            init_ray(num_cpus=world + engines + 1, num_gpus=torch.cuda.device_count() if use_gpus else 0)
        try:
            self._start(use_gpus)
        except BaseException:
            self.close()
            raise

    def _start(self, use_gpus: bool) -> None:
        cfg = self.config
        self.trainer = TrainerGroup(cfg.trainer.world_size, cfg.trainer, cfg.model, use_gpus=use_gpus)
        version = 0
        if self.restore is not None:  # resume: the engines start on the checkpoint's weights
            version = self.trainer.call("load_checkpoint", self.restore["trainer_dir"])
            assert version == self.restore["weight_version"], (version, self.restore["weight_version"])
        initial = str(self.run_dir / ("initial_hf" if version == 0 else f"resumed_hf_v{version}"))
        self.trainer.call("save_hf", initial)
        server = ray.remote(EngineServer).options(num_cpus=1, num_gpus=0)
        self.engines = [server.remote(initial, cfg.engines.kind, cfg.engines.max_batch, cfg.engines.threads,
                                      str(self.run_dir / f"engine-{i}.log"), version)
                        for i in range(cfg.engines.count)]
        urls = ray.get([engine.url.remote() for engine in self.engines])
        self.trainer.call("connect", urls, cfg.sync, cfg.engines.kind)
        hf = cfg.model.load_hf_config()
        worker = ray.remote(RolloutWorker).options(num_cpus=1, max_concurrency=16)
        self.rollout = worker.remote(cfg.effective_rollout(), urls, cfg.engines.kind,
                                     hf.num_hidden_layers, hf.num_experts_per_tok)
        ray.get(self.rollout.start.remote(self.restore))

    def close(self) -> dict | None:
        ledger = None
        try:
            if self.rollout is not None:
                ledger = ray.get(self.rollout.stop.remote())
        finally:
            if self.trainer is not None:
                self.trainer.close()
            for engine in self.engines:
                ray.get(engine.stop.remote())
            ray.shutdown()
        return ledger
