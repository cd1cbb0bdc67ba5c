"""Import: an HF safetensors checkpoint -> this rank's Megatron shards, for any layout.

Each rank reads only the slices its parameters need (its TP/ETP rows or columns, its EP
experts, its PP stage's layers) and copies them into the model in place. Every parameter must
have a mapping and every HF tensor must be used by some rank: ValueError names the offender.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

from parallel.bridges import Bridge
from parallel.context import parallel_context, uses_transformer_engine
from parallel.export import model_chunks, model_tensors
from parallel.hf_checkpoint import HFCheckpointReader
from parallel.mappings import resolve


def load_hf_weights(model, bridge: Bridge, hf_dir: str | os.PathLike) -> None:
    """Fill `model` (this rank's stage: a GPTModel, or the list of its virtual-pipeline chunks)
    from the HF checkpoint at `hf_dir`.

    Collective: every rank of the world calls it (one all_gather_object of the HF names each
    rank used, to check that no HF tensor was left unmapped). Memory: one parameter's slices.
    """
    reader = HFCheckpointReader(hf_dir)
    used = _left_out(reader, bridge)
    with torch.no_grad():
        for chunk in model_chunks(model):
            ctx = parallel_context(chunk, bridge)
            table = bridge.mappings(te=uses_transformer_engine(chunk))
            for name, param in model_tensors(chunk).items():
                mapping, indices = resolve(table, name)
                shard = mapping.load(reader, ctx, indices, param.shape)
                param.copy_(shard.to(param.dtype))
                used.update(mapping.hf_names(ctx, indices))
    reader.close()
    everyone: list = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
    if dist.is_initialized():
        dist.all_gather_object(everyone, sorted(used))
    else:
        everyone = [sorted(used)]
    unused = reader.names() - set().union(*map(set, everyone))
    if unused:
        raise ValueError(
            f"HF checkpoint {hf_dir} has {len(unused)} tensors no Megatron parameter maps to, e.g. "
            f"{sorted(unused)[:5]}: the bridge for {type(bridge).__name__} lacks their mapping"
        )


def _left_out(reader: HFCheckpointReader, bridge: Bridge) -> set[str]:
    """Checkpoint tensors the model leaves out on purpose, each kind said once (rank 0): the
    multi-token-prediction layers of a model built `without_mtp` and `rotary_emb.inv_freq`
    buffers (already not listed by the reader). MTP layers the config declares but the checkpoint
    lacks: a note where the model was built as stored (`hf_checkpoint.as_stored`), else a ValueError."""
    stored = reader.mtp_names()
    if bridge.mtp_layers and not stored:
        raise ValueError(
            f"{reader.dir}: the model has {bridge.mtp_layers} MTP layer(s) but the checkpoint holds none: build it "
            "from parallel.hf_checkpoint.load_hf_config (or as_stored), which leaves them out, or set model.mtp: drop"
        )
    dropped = set() if bridge.mtp_layers else stored
    if not dist.is_initialized() or dist.get_rank() == 0:
        declared = reader.config.get("num_nextn_predict_layers") or 0
        if declared and not stored:
            print(
                f"[import] config.json declares {declared} MTP layer(s) that the checkpoint does not hold "
                "(as transformers' save_pretrained writes DeepSeek-V3 / GLM-4.5): building the model without them"
            )
        if dropped:
            layers = sorted({".".join(name.split(".")[:3]) + ".*" for name in dropped})
            warnings.warn(
                f"model.mtp=drop: {len(dropped)} tensors of the multi-token-prediction layers "
                f"{', '.join(layers)} are not imported, and no export or weight sync will carry them",
                stacklevel=3,
            )
        if reader.ignored:
            print(
                f"[import] ignoring {len(reader.ignored)} rotary_emb.inv_freq buffers: every model recomputes "
                "them from the config's rope settings"
            )
    return dropped
