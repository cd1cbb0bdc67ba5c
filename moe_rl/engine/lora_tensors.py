"""SGLang 0.5.23's `/load_lora_adapter_from_tensors` payload: encoding (client) and decoding (embedded engine).

SGLang's body (`LoadLoRAAdapterFromTensorsReqInput`): `lora_name`, `config_dict` (PEFT's
adapter_config.json), `serialized_named_tensors` (one base64 `MultiprocessingSerializer` payload per
TP rank: each rank unpickles its own with SGLang's `SafeUnpickler`), `load_format` and
`expected_checksums` ({tensor name: sha256 hex of its bytes}, checked by every rank after
decoding: a missing, extra or different tensor fails the load). With `load_format
"flattened_bucket"` a payload is `{"flattened_tensor": uint8 [n], "metadata":
[FlattenedTensorMetadata(name, shape, dtype, start_idx, end_idx, numel)]}` (one tensor for the
whole adapter); with `load_format` None it is `{name: tensor}`.

Tensors travel by value (`sync.flattened_payload`, `share=False`): the payload is a plain pickle
of CPU tensors (storage bytes inline, what SGLang's unpickler loads through
`torch.load(weights_only=True)`), so it works across machines. (SGLang's own
`MultiprocessingSerializer.serialize` shares CPU storage through file descriptors, valid only on
the same host while the sender lives.) The pickle names SGLang's `FlattenedTensorMetadata` class
without importing SGLang, and storages by torch's own `torch.storage._load_from_bytes` even where
megatron-core (0.19) has replaced that function with its
`megatron.core.safe_globals.safe_load_from_bytes`, a name SGLang's unpickler refuses.
Memory: a payload holds the adapter once (as bytes) plus its base64 text, once per TP rank in the
JSON body.

The embedded engine decodes with `decode_payload` (`sync.flattened_payload.decode`: a restricted
unpickler; anything but tensors, dtypes, sizes and SGLang's metadata class is refused).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Iterable, Mapping

import torch
from safetensors.torch import load_file

from sync.flattened_payload import decode, flatten, serialize

LOAD_FORMATS = ("flattened_bucket", None)


def tensor_sha256(tensor: torch.Tensor) -> str:
    """SGLang's `expected_checksums` digest (managers/tp_worker.py): sha256 of the tensor's bytes."""
    return hashlib.sha256(tensor.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()).hexdigest()


def read_adapter_dir(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json, {PEFT name: tensor}) of a PEFT `save_pretrained` directory."""
    path = Path(path)
    config_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        raise ValueError(f"{path}: needs adapter_config.json and adapter_model.safetensors (PEFT save_pretrained)")
    return json.loads(config_file.read_text()), load_file(str(weights_file))


# -- encoding --------------------------------------------------------------------------------------


def encode_payload(named_tensors: Mapping[str, torch.Tensor], load_format: str | None) -> str:
    """One rank's `serialized_named_tensors` entry (base64) for `named_tensors`."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r}: use one of {LOAD_FORMATS}")
    if not named_tensors:
        raise ValueError("an adapter needs at least one tensor")
    tensors = {name: t.detach().cpu().contiguous() for name, t in named_tensors.items()}
    return serialize(tensors if load_format is None else flatten(tensors), share=False)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraTensorsBody:
    """SGLang 0.5.23's `LoadLoRAAdapterFromTensorsReqInput` as the client sends it."""

    lora_name: str
    config_dict: dict
    serialized_named_tensors: list[str]
    """One `encode_payload` entry per engine TP rank (the same bytes for every rank)."""
    load_format: str | None
    expected_checksums: dict[str, str] | None
    pinned: bool = False

    @classmethod
    def build(
        cls,
        lora_name: str,
        config_dict: dict,
        named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        tp_size: int = 1,
        *,
        load_format: str | None = "flattened_bucket",
        pinned: bool = False,
        verify: bool = True,
    ) -> "LoraTensorsBody":
        tensors = dict(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        bad = [n for n, t in tensors.items() if not isinstance(n, str) or not isinstance(t, torch.Tensor)]
        if bad:
            raise ValueError(f"named_tensors: {bad[:3]} are not (str name, torch.Tensor) pairs")
        if not isinstance(config_dict, dict) or not isinstance(config_dict.get("r"), int):
            raise ValueError("config_dict must be PEFT's adapter_config.json as a dict (with an integer r)")
        try:
            config = json.loads(json.dumps(config_dict))
        except (TypeError, ValueError) as error:
            raise ValueError(f"config_dict must be JSON-serializable: {error}") from None
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tp_size must be the engine's TP size (an integer >= 1), got {tp_size!r}")
        payload = encode_payload(tensors, load_format)
        checksums = {name: tensor_sha256(t) for name, t in tensors.items()} if verify else None
        return cls(
            lora_name=lora_name,
            config_dict=config,
            serialized_named_tensors=[payload] * tp_size,
            load_format=load_format,
            expected_checksums=checksums,
            pinned=pinned,
        )

    def to_json(self) -> dict:
        body = dataclasses.asdict(self)
        return {k: v for k, v in body.items() if v is not None or k == "load_format"}


# -- decoding (the embedded engine) ----------------------------------------------------------------


def decode_payload(payload: str, load_format: str | None) -> dict[str, torch.Tensor]:
    """The named tensors of one `serialized_named_tensors` entry (ValueError when malformed)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r}: use one of {LOAD_FORMATS}")
    return decode(payload, flattened=load_format is not None)


def check_checksums(tensors: Mapping[str, torch.Tensor], expected: Mapping[str, str] | None) -> None:
    """SGLang's check: every expected name present with that digest, and no other tensor."""
    if expected is None:
        return
    missing = [n for n in expected if n not in tensors]
    mismatch = [n for n in expected if n in tensors and tensor_sha256(tensors[n]) != expected[n]]
    extra = [n for n in tensors if n not in expected]
    if missing or mismatch or extra:
        raise ValueError(
            f"expected_checksums: {len(mismatch)} value-diff {mismatch[:5]}, {len(missing)} missing "
            f"{missing[:5]}, {len(extra)} extra {extra[:5]}"
        )
