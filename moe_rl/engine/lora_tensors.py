"""SGLang 0.5.23's `/load_lora_adapter_from_tensors` payload: encoding (client) and decoding (embedded engine).

SGLang's body (`LoadLoRAAdapterFromTensorsReqInput`): `lora_name`, `config_dict` (PEFT's
adapter_config.json), `serialized_named_tensors` (one base64 `MultiprocessingSerializer` payload per
TP rank: each rank unpickles its own with SGLang's `SafeUnpickler`), `load_format` and
`expected_checksums` ({tensor name: sha256 hex of its bytes}, checked by every rank after
decoding: a missing, extra or different tensor fails the load). With `load_format
"flattened_bucket"` a payload is `{"flattened_tensor": uint8 [n], "metadata":
[FlattenedTensorMetadata(name, shape, dtype, start_idx, end_idx, numel)]}` (one tensor for the
whole adapter); with `load_format` None it is `{name: tensor}`.

Tensors travel by value: the payload is a plain pickle of CPU tensors (storage bytes inline, what
SGLang's unpickler loads through `torch.load(weights_only=True)`), so it works across machines.
(SGLang's own `MultiprocessingSerializer.serialize` shares CPU storage through file descriptors,
valid only on the same host while the sender lives.) The pickle names SGLang's
`FlattenedTensorMetadata` class without importing SGLang, and storages by torch's own
`torch.storage._load_from_bytes` even where megatron-core (0.19) has replaced that function with
its `megatron.core.safe_globals.safe_load_from_bytes`, a name SGLang's unpickler refuses.
Memory: a payload holds the adapter once (as bytes) plus its base64 text, once per TP rank in the
JSON body.

The embedded engine decodes with `decode_payload`: a restricted unpickler that admits only what
`encode_payload` writes (tensors, dtypes, sizes, SGLang's metadata class); anything else is refused.
"""

from __future__ import annotations

import base64
import binascii
import collections
import copyreg
import dataclasses
import hashlib
import io
import json
import pickle
import types
from pathlib import Path
from typing import Iterable, Mapping

import torch

LOAD_FORMATS = ("flattened_bucket", None)
_METADATA = ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")
_ALIGN = 16  # every tensor starts at a multiple of this in the bucket: `.view(dtype)` needs it


@dataclasses.dataclass
class FlattenedTensorMetadata:
    """Stand-in for SGLang's class of the same name (same fields); pickled under SGLang's name."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def tensor_sha256(tensor: torch.Tensor) -> str:
    """SGLang's `expected_checksums` digest (managers/tp_worker.py): sha256 of the tensor's bytes."""
    return hashlib.sha256(tensor.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()).hexdigest()


def read_adapter_dir(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json, {PEFT name: tensor}) of a PEFT `save_pretrained` directory."""
    from safetensors.torch import load_file

    path = Path(path)
    config_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        raise ValueError(f"{path}: needs adapter_config.json and adapter_model.safetensors (PEFT save_pretrained)")
    return json.loads(config_file.read_text()), load_file(str(weights_file))


# -- encoding --------------------------------------------------------------------------------------


class _Pickler(pickle._Pickler):  # the Python pickler: the C one cannot name a class it cannot import
    def save_global(self, obj, name=None):
        if obj is FlattenedTensorMetadata:
            self._save_as(obj, *_METADATA)
        elif obj is torch.storage._load_from_bytes:  # whatever megatron-core put there: torch's name
            self._save_as(obj, "torch.storage", "_load_from_bytes")
        else:
            super().save_global(obj, name)

    def _save_as(self, obj, module: str, name: str) -> None:
        self.save(module)
        self.save(name)
        self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)

    dispatch = dict(pickle._Pickler.dispatch)
    dispatch[types.FunctionType] = save_global  # the base table holds the base class's save_global


def encode_payload(named_tensors: Mapping[str, torch.Tensor], load_format: str | None) -> str:
    """One rank's `serialized_named_tensors` entry (base64) for `named_tensors`."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r}: use one of {LOAD_FORMATS}")
    if not named_tensors:
        raise ValueError("an adapter needs at least one tensor")
    tensors = {name: t.detach().cpu().contiguous() for name, t in named_tensors.items()}
    if load_format is None:
        obj: object = tensors
    else:
        metadata, pieces, offset = [], [], 0
        for name, t in tensors.items():
            pad = -offset % _ALIGN
            if pad:
                pieces.append(torch.zeros(pad, dtype=torch.uint8))
                offset += pad
            flat = t.flatten().view(torch.uint8)
            metadata.append(
                FlattenedTensorMetadata(name, t.shape, t.dtype, offset, offset + flat.numel(), flat.numel())
            )
            pieces.append(flat)
            offset += flat.numel()
        obj = {"flattened_tensor": torch.cat(pieces), "metadata": metadata}
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=4).dump(obj)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


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


def _load_storage(data: bytes):
    storage = torch.load(io.BytesIO(data), weights_only=True)
    if not isinstance(storage, (torch.storage.TypedStorage, torch.UntypedStorage)):
        raise pickle.UnpicklingError(f"expected a torch storage, got {type(storage).__name__}")
    return storage


class _Unpickler(pickle.Unpickler):
    _ALLOWED = {
        ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
        ("torch.storage", "_load_from_bytes"): _load_storage,
        ("torch", "Size"): torch.Size,
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("copyreg", "__newobj__"): copyreg.__newobj__,
        _METADATA: FlattenedTensorMetadata,
    }

    def find_class(self, module, name):
        if (module, name) in self._ALLOWED:
            return self._ALLOWED[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"{module}.{name} is not allowed in a tensor payload (the embedded engine takes "
            "by-value CPU tensors, as EngineClient.load_lora_adapter_from_tensors sends)"
        )


def decode_payload(payload: str, load_format: str | None) -> dict[str, torch.Tensor]:
    """The named tensors of one `serialized_named_tensors` entry (ValueError when malformed)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r}: use one of {LOAD_FORMATS}")
    try:
        data = _Unpickler(io.BytesIO(base64.b64decode(payload, validate=True))).load()
    except (binascii.Error, pickle.UnpicklingError, EOFError, TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"serialized_named_tensors: not a tensor payload ({type(error).__name__}: {error})") from None
    if load_format is None:
        if not isinstance(data, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in data.items()
        ):
            raise ValueError("serialized_named_tensors: with load_format null a payload is {name: tensor}")
        return dict(data)
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("flattened_tensor"), torch.Tensor)
        or not all(isinstance(m, FlattenedTensorMetadata) for m in data.get("metadata") or [None])
    ):
        raise ValueError("serialized_named_tensors: a flattened_bucket payload is {flattened_tensor, metadata}")
    flat, tensors = data["flattened_tensor"], {}
    for meta in data["metadata"]:
        if not 0 <= meta.start_idx <= meta.end_idx <= flat.numel():
            raise ValueError(f"serialized_named_tensors: {meta.name} lies outside the flattened tensor")
        tensors[meta.name] = flat[meta.start_idx : meta.end_idx].view(meta.dtype).reshape(meta.shape)
    return tensors


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
