"""SGLang 0.5.23's flattened-bucket payload, written and read without SGLang.

One entry of `serialized_named_tensors` (`/update_weights_from_tensor`,
`/load_lora_adapter_from_tensors`) is base64 of a pickle of
`{"flattened_tensor": uint8 [n], "metadata": [FlattenedTensorMetadata(name, shape, dtype,
start_idx, end_idx, numel)]}`; SGLang's unpickler accepts exactly its own metadata class
(`sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata`), so `PayloadPickler` writes the
stand-in class here under that name.

Two ways a tensor travels:
- by value (`share=False`): storage bytes inline, valid on any machine (LoRA adapters over HTTP);
- shared (`share=True`): torch's multiprocessing reducers, as SGLang's `MultiprocessingSerializer`
  uses them: a CUDA tensor becomes a CUDA-IPC handle to the sender's memory (the `cuda_ipc`
  transport), valid on the same node while the sender keeps the buffer.

`decode` is the engine side: a restricted unpickler that admits only tensors, dtypes, sizes, the
metadata class and CUDA-IPC rebuilds (torch's, or SGLang's patched one, whose device is a GPU UUID
that `decode` resolves to this process's device index); anything else is refused by name.
"""

from __future__ import annotations

import base64
import binascii
import collections
import copyreg
import dataclasses
import io
import pickle
import types
from multiprocessing.reduction import ForkingPickler

import torch
from torch.multiprocessing import reductions

SGLANG_METADATA = ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")
_SGLANG_REBUILD = ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified")
_DEVICE_ARG = 6  # rebuild_cuda_tensor's device argument (SGLang's patch puts a GPU UUID there)
ALIGN = 16  # every tensor starts at a multiple of this in a bucket: `.view(dtype)` needs it


@dataclasses.dataclass
class FlattenedTensorMetadata:
    """Stand-in for SGLang's class of the same name (same fields); pickled under SGLang's name."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


class PayloadPickler(pickle._Pickler):  # the Python pickler: the C one cannot name a class it cannot import
    def __init__(self, file, share: bool):
        super().__init__(file, protocol=4)
        if share:  # torch's reducers (CUDA-IPC handles), as ForkingPickler applies them
            self.dispatch_table = {**copyreg.dispatch_table, **ForkingPickler._extra_reducers}

    def save_global(self, obj, name=None):
        if obj is FlattenedTensorMetadata:
            self._save_as(obj, *SGLANG_METADATA)
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


def flatten(named_tensors: dict[str, torch.Tensor]) -> dict:
    """A payload holding `named_tensors` (copied into one uint8 tensor on their device)."""
    metadata, pieces, offset = [], [], 0
    for name, t in named_tensors.items():
        pad = -offset % ALIGN
        if pad:
            pieces.append(torch.zeros(pad, dtype=torch.uint8, device=t.device))
            offset += pad
        flat = t.contiguous().flatten().view(torch.uint8)
        metadata.append(FlattenedTensorMetadata(name, t.shape, t.dtype, offset, offset + flat.numel(), flat.numel()))
        pieces.append(flat)
        offset += flat.numel()
    return {"flattened_tensor": torch.cat(pieces), "metadata": metadata}


def serialize(obj: object, share: bool) -> str:
    """base64 of the pickle of `obj` (see the module docstring for `share`)."""
    buffer = io.BytesIO()
    PayloadPickler(buffer, share).dump(obj)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


# -- decoding (the engine side) --------------------------------------------------------------------


def _load_storage(data: bytes):
    storage = torch.load(io.BytesIO(data), weights_only=True)
    if not isinstance(storage, (torch.storage.TypedStorage, torch.UntypedStorage)):
        raise pickle.UnpicklingError(f"expected a torch storage, got {type(storage).__name__}")
    return storage


def _rebuild_ipc_tensor(*args):
    """torch's CUDA-IPC rebuild; a device named by UUID (SGLang's patch) becomes its index here."""
    device = args[_DEVICE_ARG]
    if isinstance(device, str):
        found = [i for i in range(torch.cuda.device_count()) if str(torch.cuda.get_device_properties(i).uuid) == device]
        if not found:
            raise pickle.UnpicklingError(f"CUDA-IPC tensor on GPU {device}, which this process cannot see")
        args = (*args[:_DEVICE_ARG], found[0], *args[_DEVICE_ARG + 1 :])
    elif not isinstance(device, int):
        raise pickle.UnpicklingError(f"CUDA-IPC tensor with device {device!r}")
    return reductions.rebuild_cuda_tensor(*args)


class _Unpickler(pickle.Unpickler):
    _ALLOWED = {
        ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
        ("torch.storage", "_load_from_bytes"): _load_storage,
        ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): _rebuild_ipc_tensor,
        _SGLANG_REBUILD: _rebuild_ipc_tensor,
        ("torch", "Tensor"): torch.Tensor,
        ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
        ("torch.storage", "TypedStorage"): torch.storage.TypedStorage,  # a CUDA-IPC tensor's storage class
        ("torch", "Size"): torch.Size,
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("copyreg", "__newobj__"): copyreg.__newobj__,
        SGLANG_METADATA: FlattenedTensorMetadata,
    }

    def find_class(self, module, name):
        if (module, name) in self._ALLOWED:
            return self._ALLOWED[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"{module}.{name} is not allowed in a tensor payload (tensors by value or by CUDA-IPC handle, "
            "SGLang's flattened-bucket metadata)"
        )


def decode(payload: str, flattened: bool) -> dict[str, torch.Tensor]:
    """The named tensors of one `serialized_named_tensors` entry: a flattened bucket's (views of its
    flat tensor), or a plain `{name: tensor}` where `flattened` is False. ValueError when malformed."""
    try:
        data = _Unpickler(io.BytesIO(base64.b64decode(payload, validate=True))).load()
    except (binascii.Error, pickle.UnpicklingError, EOFError, TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"serialized_named_tensors: not a tensor payload ({type(error).__name__}: {error})") from None
    if not flattened:
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
