"""Checkpoint conversion through the bridges: the rank functions behind `moe-rl convert`.

Each `*_to_*` function runs on every rank of a gloo/NCCL world (spawned by `moe-rl convert`, or
torchrun) whose `ParallelLayout` the caller chose; all ranks call it, every collective inside is
entered by every rank, and global rank 0 publishes `<out>.tmp` as `<out>` once all ranks wrote.

hf-to-megatron: every rank builds its stage of the Megatron model, reads only its slices of the HF
safetensors and writes its shards of one torch_dist checkpoint of `model.sharded_state_dict()`
(plain keys), plus `moe_rl_meta.json` and the HF side files (`moe_rl.conversion.directory` has the format).
megatron-to-hf: loads such a checkpoint at any layout and streams HF safetensors shards out of each
pipeline stage (`parallel.export.save_hf_checkpoint`). peft-to-megatron / megatron-to-peft: only
LoRA adapters move (`parallel.lora`, `parallel.peft`); no base weights are read.

Memory: one rank's share of the model, plus one export bucket (`bucket_bytes`) while writing HF.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch.distributed as dist
from rich.progress import DownloadColumn, Progress, TransferSpeedColumn

from moe_rl.conversion.directory import HF_FILES_DIR, META_FILE, write_lora_meta
from parallel.bridges import bridge_for, without_mtp
from parallel.dist_checkpoint import save_sharded
from parallel.export import save_hf_checkpoint
from parallel.fp8 import BlockFP8
from parallel.hf_checkpoint import load_hf_config
from parallel.hf_import import load_hf_weights
from parallel.lora import TARGETS, LoRAConfig, adapter_sharded_state_dict, add_lora
from parallel.model import build_gpt_model, init_model_parallel
from parallel.peft import hf_lora_targets, load_adapter, lora_config_of, read_adapter_config, save_adapter
from parallel.staging import fresh_staging, publish, staging_dir


def source_hf_config(hf_dir: str, drop_mtp: bool) -> dict:
    """The HF config of `hf_dir`, without the multi-token-prediction layers when `drop_mtp`."""
    hf_config = load_hf_config(hf_dir)
    return without_mtp(hf_config) if drop_mtp else hf_config


def hf_to_megatron(layout, hf_dir: str, out: str, drop_mtp: bool) -> None:
    """Rank function (every rank): import this rank's shards, save torch_dist, rename."""
    hf_config = source_hf_config(hf_dir, drop_mtp)
    bridge, model = _build(hf_config, layout)
    tmp = _fresh_tmp(out)
    _say(f"importing {hf_dir} at tp={layout.tp} pp={layout.pp} ep={layout.ep} etp={layout.expert_tp}")
    load_hf_weights(model, bridge, hf_dir)
    _say(f"saving torch_dist checkpoint to {tmp}")
    save_sharded(model.sharded_state_dict(), tmp)
    if dist.get_rank() == 0:
        (tmp / META_FILE).write_text(
            json.dumps(
                {"hf_config": hf_config, "format": "torch_dist", "state_dict": "model.sharded_state_dict()"}, indent=2
            )
        )
        side = tmp / HF_FILES_DIR
        side.mkdir()
        for path in Path(hf_dir).iterdir():
            if (
                path.is_file()
                and not path.name.endswith(".safetensors")
                and path.name != "model.safetensors.index.json"
            ):
                shutil.copy(path, side / path.name)
        publish(tmp, out)
    dist.barrier()


def megatron_to_hf(
    layout, ckpt_dir: str, out: str, max_shard_bytes: int, bucket_bytes: int, fp8_blocks: int | None
) -> None:
    """Rank function (every rank): load torch_dist at `layout`, stream HF tensors, write shards."""
    from megatron.core import dist_checkpointing  # heavy: megatron-core, only on the conversion ranks

    hf_config = json.loads((Path(ckpt_dir) / META_FILE).read_text())["hf_config"]
    bridge, model = _build(hf_config, layout)
    _say(f"loading {ckpt_dir} at tp={layout.tp} pp={layout.pp} ep={layout.ep} etp={layout.expert_tp}")
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir))
    side = {p.name: p.read_bytes() for p in (Path(ckpt_dir) / HF_FILES_DIR).glob("*") if p.name != "config.json"}
    with _progress("writing HF shards") as advance:
        save_hf_checkpoint(
            model,
            bridge,
            out,
            hf_config,
            max_shard_bytes=max_shard_bytes,
            bucket_bytes=bucket_bytes,
            extra_files=side,
            progress=advance,
            fp8=None if fp8_blocks is None else BlockFP8(fp8_blocks, fp8_blocks),
        )


def peft_to_megatron(layout, peft_dir: str, out: str, hf_dir: str) -> None:
    """Rank function: build the model with adapters matching the PEFT file, fill them, save them."""
    hf_config = load_hf_config(hf_dir)
    bridge, model = _build(hf_config, layout)
    lora = lora_config_of(peft_dir, target_modules=_megatron_targets(bridge, peft_dir, TARGETS))
    add_lora(model, bridge, lora, seed=0)
    load_adapter(model, bridge, peft_dir)
    tmp = _fresh_tmp(out)
    _say(f"saving the adapters of {peft_dir} to {tmp}")
    save_sharded(adapter_sharded_state_dict(model), tmp)
    if dist.get_rank() == 0:
        write_lora_meta(tmp, hf_config, lora)
        publish(tmp, out)
    dist.barrier()


def megatron_to_peft(layout, ckpt_dir: str, out: str) -> None:
    """Rank function: load the adapters of a torch_dist checkpoint at `layout`, write PEFT."""
    from megatron.core import dist_checkpointing  # heavy: megatron-core, only on the conversion ranks

    meta = json.loads((Path(ckpt_dir) / META_FILE).read_text())
    if "lora" not in meta:
        raise ValueError(f"{ckpt_dir}: {META_FILE} has no lora settings: it holds no adapters (use megatron-to-hf)")
    lora = LoRAConfig(**meta["lora"])
    bridge, model = _build(meta["hf_config"], layout)
    add_lora(model, bridge, lora, seed=0)
    request = adapter_sharded_state_dict(model)
    _say(f"loading the adapters of {ckpt_dir} at tp={layout.tp} pp={layout.pp} ep={layout.ep} etp={layout.expert_tp}")
    model.load_state_dict(dist_checkpointing.load(request, ckpt_dir), strict=False)
    save_adapter(model, bridge, lora, out, base_model=meta["hf_config"].get("_name_or_path") or None)


def _build(hf_config: dict, layout):
    bridge = bridge_for(hf_config)  # ValueError for an unknown architecture, before any work
    init_model_parallel(layout, seed=0)
    return bridge, build_gpt_model(bridge, layout)


def _fresh_tmp(out: str) -> Path:
    """Rank 0 empties `<out>.tmp`; every rank calls it (barrier)."""
    if dist.get_rank() == 0:
        fresh_staging(out)
    dist.barrier()
    return staging_dir(out)


def _megatron_targets(bridge, peft_dir: str, targets) -> list[str]:
    """The Megatron modules whose HF names the adapter file covers."""
    wanted = set(read_adapter_config(peft_dir)["target_modules"])
    chosen = [t for t in targets if set(hf_lora_targets(bridge, [t])) & wanted]
    if not chosen:
        raise ValueError(f"{peft_dir}: target_modules {sorted(wanted)} match no module of this model")
    return chosen


def _say(message: str) -> None:
    if dist.get_rank() == 0:
        print(f"[convert] {message}", flush=True)


class _progress:
    """A rich progress bar of bytes written, shown on global rank 0 only."""

    def __init__(self, title: str):
        self.title, self.bar = title, None
        if dist.get_rank() == 0:
            self.bar = Progress(*Progress.get_default_columns()[:1], DownloadColumn(), TransferSpeedColumn())

    def __enter__(self):
        if self.bar is None:
            return lambda nbytes: None
        self.bar.start()
        task = self.bar.add_task(self.title, total=None)
        return lambda nbytes: self.bar.advance(task, nbytes)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()
