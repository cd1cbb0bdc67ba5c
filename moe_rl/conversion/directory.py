"""The converted-checkpoint directory that `moe-rl convert hf-to-megatron` writes, and training from it.

Layout: a Megatron dist_checkpointing (torch_dist) checkpoint of `model.sharded_state_dict()`
(plain keys), `moe_rl_meta.json` ({"hf_config": the HF config.json fields, "format": "torch_dist",
...}) and the HF side files (tokenizer, generation config) under `hf_files/`. On a cluster the
checkpoint is converted once and every job starts from it (`model.path: <converted dir>`): each
rank loads its shards at the job's layout through Megatron's resharding load, equal bit for bit
to importing the HF original, instead of re-reading (and re-dequantizing) the HF shards.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

META_FILE = "moe_rl_meta.json"
HF_FILES_DIR = "hf_files"
DIST_METADATA = ".metadata"  # torch_dist's index: present once the weights were written


def is_converted(directory: str | Path) -> bool:
    return (Path(directory) / META_FILE).is_file()


def read_meta(directory: str | Path) -> dict:
    """`moe_rl_meta.json` of a converted model checkpoint, checked (ValueError naming the fix)."""
    directory = Path(directory)
    try:
        meta = json.loads((directory / META_FILE).read_text())
    except ValueError as error:
        raise ValueError(f"model.path={str(directory)!r}: {META_FILE} is not JSON ({error})") from error
    if not isinstance(meta, dict) or not isinstance(meta.get("hf_config"), dict) or meta.get("format") != "torch_dist":
        raise ValueError(f"model.path={str(directory)!r}: {META_FILE} is not from `moe-rl convert hf-to-megatron`")
    if "lora" in meta:
        raise ValueError(
            f"model.path={str(directory)!r} holds LoRA adapters (peft-to-megatron), not a model: point "
            "model.path at the base model"
        )
    if not (directory / DIST_METADATA).is_file():
        raise ValueError(
            f"model.path={str(directory)!r} has {META_FILE} but no weights (no torch_dist {DIST_METADATA}; "
            f"only {HF_FILES_DIR}/?): convert again with `moe-rl convert hf-to-megatron`, or point model.path "
            "at the HF model"
        )
    return meta


def write_lora_meta(directory: Path, hf_config: dict, lora) -> None:
    """`moe_rl_meta.json` of an adapter checkpoint (`lora` a `parallel.lora.LoRAConfig`): what
    `moe-rl convert megatron-to-peft` needs to rebuild it."""
    (directory / META_FILE).write_text(
        json.dumps({"hf_config": hf_config, "lora": dataclasses.asdict(lora), "format": "torch_dist"}, indent=2)
    )


def load_model_weights(model, bridge, path: str) -> None:
    """Fill this rank's shards of `model` from `path`: a converted checkpoint (Megatron's resharding
    load, any layout) or an HF safetensors directory (through the bridge). Collective."""
    if is_converted(path):
        # heavy: megatron-core, loaded only where a model is built (after parallel.cpu_compat.apply)
        from megatron.core import dist_checkpointing

        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), path))
    else:
        # heavy: torch and the bridges; this module stays light (`moe-rl convert` reads META_FILE here)
        from parallel.hf_import import load_hf_weights

        load_hf_weights(model, bridge, path)
