"""The Megatron trainer world as Ray actors: one `TrainerRank` per rank, driven in lockstep.

`TrainerGroup` (driver side) creates the actors in a placement group (one bundle per rank: CPUs
here, one GPU each on clusters), lets rank 0 pick the rendezvous (its node address and a free
port), and calls every actor's method at once: each method runs collectives, so every rank must
enter it. Results are rank 0's (the ranks agree). Each actor calls `cpu_compat.apply()` on the
thread that runs Megatron (the CPU patches are per thread for the device-literal mode).
"""

from __future__ import annotations

import os
import time
from typing import Any

import ray
import torch

from moe_rl.algorithms import AlgorithmConfig, make_policy_loss, policy_metrics


class TrainerRank:
    """One rank of the trainer world (a Ray actor). `cpus`: pin the rank's process to these cores
    (`cpu_pools.trainer`) first, before torch starts its thread pool."""

    def __init__(self, rank: int, world_size: int, threads: int, cpus: list[int] | None = None):
        self.rank, self.world_size = rank, world_size
        if cpus:
            from moe_rl.cpu_pools import pin_process

            pin_process(cpus)
        torch.set_num_threads(threads)
        self.trainer = self.sender = None

    def cpus(self) -> dict:
        """The cores this rank's process may run on and its torch threads (what the pools gave it)."""
        from moe_rl.cpu_pools import process_cores

        return {"cores": process_cores(os.getpid()), "threads": torch.get_num_threads()}

    def device(self) -> tuple[str, list[str]]:
        """(node address, the GPU ids Ray gave this rank): where colocated engines may run."""
        return ray.util.get_node_ip_address(), [str(gpu) for gpu in ray.get_gpu_ids()]

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0: the address and a free port for the gloo/NCCL world."""
        from parallel.world import free_port

        return ray.util.get_node_ip_address(), free_port()

    def setup(self, master: tuple[str, int], trainer_config, model_config, lora=None) -> None:
        """Join the world and build this rank's model, DDP and optimizer (collective)."""
        from moe_rl.trainer.megatron_trainer import MegatronTrainer
        from parallel import cpu_compat
        from parallel.world import init_distributed

        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK="0",
                          MASTER_ADDR=master[0], MASTER_PORT=str(master[1]))
        init_distributed()
        if not torch.cuda.is_available():
            cpu_compat.apply()
        self.hf_config = model_config.load_hf_config()
        self.model_path = model_config.path
        self.trainer = MegatronTrainer(trainer_config, self.hf_config, lora=lora)
        if model_config.path is not None:
            self.trainer.load_hf_weights(model_config.path)

    def _enter(self) -> None:
        if not torch.cuda.is_available():
            from parallel import cpu_compat

            cpu_compat.apply()  # idempotent; Ray may run a method on another thread

    def save_hf(self, out_dir: str, merged: bool = True, fp8_blocks: int | None = None) -> None:
        """The weights as an HF checkpoint; with LoRA, `merged=False` writes the frozen base alone
        (what adapter engines serve); `fp8_blocks`: as FP8 blocks (engines that serve FP8)."""
        self._enter()
        self.trainer.save_hf_checkpoint(out_dir, self.hf_config.to_dict(), merged=merged, fp8=_fp8(fp8_blocks))

    def save_adapter(self, out_dir: str) -> None:
        """LoRA: the adapters as a PEFT directory (collective)."""
        self._enter()
        self.trainer.save_adapter(out_dir, self.model_path)

    def save_checkpoint(self, directory: str) -> None:
        """Megatron dist checkpoint: model, optimizer, RNG, step (collective, atomic)."""
        from moe_rl.trainer.checkpoint import save_checkpoint

        self._enter()
        save_checkpoint(self.trainer, directory)

    def load_checkpoint(self, directory: str) -> int:
        """Load a dist checkpoint into the built trainer (collective); returns its optimizer step."""
        from moe_rl.trainer.checkpoint import load_checkpoint

        self._enter()
        load_checkpoint(self.trainer, directory)
        return self.trainer.step

    def connect(self, urls: list[str], sync_config, kind: str, version: int = 0, adapters=None) -> None:
        """Find each pipeline stage's export source; the sync source builds the WeightSender
        (the engines serve `version`), or with LoRA rank 0 the AdapterSync (`adapters`: its
        sync.lora.AdapterSyncConfig), and loads the adapter of `version`."""
        import dataclasses
        from urllib.parse import urlsplit

        from moe_rl.engine.client import EngineClient, engine_name
        from parallel.export import export_source_ranks
        from sync.group import address_for
        from sync.pipeline import sync_source
        from sync.sender import WeightSender

        self._enter()
        self.sources, self.kind = export_source_ranks(), kind
        self.fp8 = _fp8(sync_config.fp8_blocks)
        if adapters is not None:
            self._connect_adapters(urls, adapters, version)
            return
        if sync_config.master_address is None:  # engines on other nodes must reach this rank
            hosts = [urlsplit(url).hostname or "127.0.0.1" for url in urls]
            sync_config = dataclasses.replace(sync_config, master_address=address_for(hosts))
        if self.rank == sync_source(self.sources):
            # one retry: a dead engine is found (and dropped) in ~0.25 s instead of ~1.75 s
            clients = [EngineClient(url, kind=kind, name=engine_name(i), retries=1) for i, url in enumerate(urls)]
            self.sender = WeightSender(clients, sync_config, version)

    def _connect_adapters(self, urls: list[str], config, version: int) -> None:
        from moe_rl.engine.client import EngineClient, engine_name
        from parallel.peft import write_adapter
        from sync.lora import AdapterSync

        if self.rank == 0:
            clients = [EngineClient(url, kind=self.kind, name=engine_name(i), retries=1) for i, url in enumerate(urls)]
            self.sender = AdapterSync(clients, config, write_adapter)
        self._publish_adapter(version)

    def _publish_adapter(self, version: int) -> dict:
        """Collect the adapters on rank 0 and load them as `policy-v{version}` (collective)."""
        collected = self.trainer.export_adapter()
        if collected is None:
            return {"engines": [], "dropped": []}
        stats = self.sender.publish(version, *collected)
        return {"engines": stats.engines, "dropped": stats.dropped, "bytes": stats.bytes}

    def sync_weights(self, version: int, bucket_bytes: int, *, joined: dict[str, str] | None = None,
                     served_version: int = 0, lost: list[str] = ()) -> dict:
        """Stream the weights to the engines as `version` (collective: every rank calls it).

        `lost`: engines known dead, removed from the sender first. `joined`: restarted engines
        (name -> url, serving `served_version`) the sender takes back; with `version` = the
        committed one only they receive it (catch-up). An engine that dies mid-sync is dropped
        and the sync retried (a fresh export) until the live engines commit. Returns seconds,
        the engines that committed, and those dropped as dead."""
        from moe_rl.engine.client import EngineClient
        from sync.engine_set import SyncError
        from sync.pipeline import stage_stream
        from sync.sender import drain

        self._enter()
        if self.trainer.lora is not None:
            return self._sync_adapters(version, joined or {}, lost)
        start, result, error = time.perf_counter(), {"engines": [], "dropped": []}, None
        if self.sender is not None:
            for name in lost:
                self.sender.remove(name)
            for name, url in (joined or {}).items():
                self.sender.add(EngineClient(url, kind=self.kind, name=name, retries=1), served_version)
        while self._agree(self.sender is not None and error is None
                          and (version > self.sender.version or bool(self.sender.behind))):
            stream = stage_stream(self.trainer.export_hf_weights(bucket_bytes), self.sources)
            if self.fp8 is not None:
                stream = self.fp8.quantize_stream(stream)
            if self.sender is None:
                drain(stream)
                continue
            try:
                stats = self.sender.update(stream, version)
                result["engines"], result["dropped"] = stats.engines, result["dropped"] + stats.dropped
            except SyncError as failure:  # retried while it was an engine dying, raised otherwise
                result["dropped"] += failure.dropped
                error = None if failure.dropped else failure
            except Exception as failure:  # noqa: BLE001 - raised below, once every rank left the loop
                error = failure
        if error is not None:
            raise error
        return {**result, "seconds": time.perf_counter() - start}

    def _sync_adapters(self, version: int, joined: dict[str, str], lost) -> dict:
        """LoRA: the new version's adapter to every engine (no pause); a restarted engine loads the
        kept versions instead (a catch-up: `version` is the one already loaded)."""
        from moe_rl.engine.client import EngineClient
        from sync.engine_set import SyncError

        start, dropped = time.perf_counter(), []
        if self.sender is not None:  # rank 0 only: the other ranks hold no sender
            for name in lost:
                self.sender.remove(name)
            for name, url in joined.items():
                try:
                    self.sender.add(EngineClient(url, kind=self.kind, name=name, retries=1))
                except SyncError:  # it died again: restarted next time (raising here would strand the ranks)
                    dropped.append(name)
        caught_up = self._agree(self.sender is not None and self.sender.version == version)
        result = {"engines": [], "dropped": []} if caught_up else self._publish_adapter(version)
        return {**result, "dropped": result["dropped"] + dropped, "seconds": time.perf_counter() - start}

    def _agree(self, decision: bool) -> bool:
        """The sync source's `decision`, on every rank (a collective over the trainer world)."""
        import torch.distributed as dist
        from sync.pipeline import sync_source

        if self.world_size == 1:
            return decision
        box = [decision]
        dist.broadcast_object_list(box, src=sync_source(self.sources))
        return bool(box[0])

    def step(self, batch: dict[str, torch.Tensor], algorithm: AlgorithmConfig) -> dict[str, float]:
        """Old logprobs (behaviour policy, with R3 when configured), reference logprobs (kl_coef > 0),
        consistency metrics, then one optimizer step per PPO mini-batch, all against these old
        logprobs (collective). Returns the step's metrics."""
        self._enter()
        trainer, mask = self.trainer, batch["loss_mask"][:, 1:].bool()
        start = time.perf_counter()
        old = trainer.forward_logprobs(batch)
        metrics = {"time/old_logprobs_s": time.perf_counter() - start,
                   **_logprob_diff(old, batch, mask, "consistency/logprob_diff")}
        if algorithm.needs_reference:
            batch = {**batch, "ref_logprobs": self._reference_logprobs(batch, algorithm, metrics)}
        if trainer.config.routing_replay:
            natural = trainer.forward_logprobs(batch, replay=False)
            metrics.update(_logprob_diff(natural, batch, mask, "consistency/logprob_diff_no_replay"))
            for layer, agreement in trainer.routing_agreement(batch).items():
                metrics[f"routing/agreement/layer{layer}"] = float(agreement)
        batch = {**batch, "old_logprobs": torch.cat([torch.zeros_like(old[:, :1]), old], dim=1)}
        start = time.perf_counter()
        result = trainer.train_step(batch, make_policy_loss(algorithm), algorithm.num_mini_batches)
        metrics["time/train_step_s"] = time.perf_counter() - start
        metrics.update({f"policy/{k}": v for k, v in policy_metrics(result.sums, result.num_tokens).items()})
        if algorithm.needs_reference:
            metrics["loss/kl"] = metrics["policy/kl"]  # mean over the trained tokens
        metrics.update({"train/grad_norm": result.grad_norm, "train/loss": result.loss,
                        "train/tokens": result.num_tokens, "train/skipped": float(result.skipped)})
        return metrics

    def _reference_logprobs(self, batch, algorithm: AlgorithmConfig, metrics: dict) -> torch.Tensor:
        """The frozen reference's logprobs at the batch's token positions (built on first use: the
        initial policy, rebuilt from model.path or trainer.seed, so a resumed run gets the same)."""
        start = time.perf_counter()
        if self.trainer.reference is None:
            self.trainer.build_reference(algorithm.ref_model_path or self.model_path)
        ref = self.trainer.reference_logprobs(batch)
        metrics["time/ref_logprobs_s"] = time.perf_counter() - start
        return torch.cat([torch.zeros_like(ref[:, :1]), ref], dim=1)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _logprob_diff(logprobs: torch.Tensor, batch, mask: torch.Tensor, name: str) -> dict[str, float]:
    """|trainer - engine| logprob over the loss tokens: mean and max."""
    diff = (logprobs - batch["rollout_logprobs"][:, 1:]).abs()[mask]
    if diff.numel() == 0:
        return {}
    return {f"{name}_mean": float(diff.mean()), f"{name}_max": float(diff.max())}


class TrainerGroup:
    """Driver side: the trainer world's actors, every call issued to all ranks at once."""

    def __init__(self, world_size: int, trainer_config, model_config, *, use_gpus: bool, lora=None,
                 cpu_pools=None):
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = {"GPU": 1, "CPU": 1} if use_gpus else {"CPU": 1}
        self.placement = placement_group([bundle] * world_size, strategy="PACK")
        ray.get(self.placement.ready())
        if cpu_pools is not None:  # moe_rl.cpu_pools.CpuPoolsConfig: each rank's cores and threads
            cores = cpu_pools.trainer_cores(world_size)
        else:  # unpinned: half the machine's cores for the trainer (the engines time-share the rest)
            cores = [(None, max(1, (os.cpu_count() or 1) // (2 * world_size)))] * world_size
        actor = ray.remote(TrainerRank)
        self.actors = [
            actor.options(num_cpus=1, num_gpus=1 if use_gpus else 0,
                          scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement, i)
                          ).remote(i, world_size, threads, cpus)
            for i, (cpus, threads) in enumerate(cores)
        ]
        master = ray.get(self.actors[0].rendezvous.remote())
        self._all(TrainerRank.setup, master, trainer_config, model_config, lora)

    # -- the ranks' methods, each run on every rank at once (see TrainerRank for what they do) --
    def step(self, batch: dict[str, torch.Tensor], algorithm: AlgorithmConfig) -> dict[str, float]:
        return self._all(TrainerRank.step, batch, algorithm)

    def sync_weights(self, version: int, bucket_bytes: int, *, joined: dict[str, str] | None = None,
                     served_version: int = 0, lost: list[str] = ()) -> dict:
        return self._all(TrainerRank.sync_weights, version, bucket_bytes, joined=joined,
                         served_version=served_version, lost=lost)

    def connect(self, urls: list[str], sync_config, kind: str, version: int = 0, adapters=None) -> None:
        self._all(TrainerRank.connect, urls, sync_config, kind, version, adapters)

    def save_hf(self, out_dir: str, merged: bool = True, fp8_blocks: int | None = None) -> None:
        self._all(TrainerRank.save_hf, out_dir, merged, fp8_blocks)

    def save_adapter(self, out_dir: str) -> None:
        self._all(TrainerRank.save_adapter, out_dir)

    def save_checkpoint(self, directory: str) -> None:
        self._all(TrainerRank.save_checkpoint, directory)

    def load_checkpoint(self, directory: str) -> int:
        return self._all(TrainerRank.load_checkpoint, directory)

    def cpus(self) -> list[dict]:
        """Every rank's cores and threads, in rank order."""
        return self._each(TrainerRank.cpus)

    def devices(self) -> list[tuple[str, list[str]]]:
        """Every rank's (node address, GPU ids), in rank order."""
        return self._each(TrainerRank.device)

    def _all(self, method, *args: Any, **kwargs: Any) -> Any:
        """`TrainerRank.method(*args, **kwargs)` on every rank (a collective); rank 0's result."""
        args = [ray.put(a) if isinstance(a, dict) else a for a in args]  # large batches: one copy
        return self._each(method, *args, **kwargs)[0]

    def _each(self, method, *args: Any, **kwargs: Any) -> list:
        return ray.get([getattr(actor, method.__name__).remote(*args, **kwargs) for actor in self.actors])

    def close(self) -> None:
        try:
            self._all(TrainerRank.close)
        finally:
            for actor in self.actors:
                ray.kill(actor)
            ray.util.remove_placement_group(self.placement)


def _fp8(blocks: int | None):
    """sync.fp8_blocks as the export's FP8 format (None: full precision)."""
    from parallel.fp8 import BlockFP8

    return None if blocks is None else BlockFP8(blocks, blocks)
