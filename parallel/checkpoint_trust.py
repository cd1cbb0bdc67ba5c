"""The trust boundary of Megatron checkpoints: pickles checked before torch or Megatron read them.

torch's distributed checkpoint stores its `.metadata` as a pickle, and Megatron's `common.pt` is a
`torch.load` file; unpickling a crafted one runs arbitrary code. HF safetensors imports are
pickle-free (`parallel.hf_import`); a Megatron checkpoint from elsewhere goes through
`check_dist_checkpoint` first: `.metadata` is unpickled with a restricted unpickler that builds
only torch's checkpoint-metadata classes, `torch.Size` and dtypes, and `common.pt` must load with
`torch.load(weights_only=True)`. Anything else is refused before any rank reads the checkpoint.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch

_METADATA_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.planner",
    "torch.distributed.checkpoint.filesystem",
)
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        allowed = (
            (module, name) in _ALLOWED
            or module in _METADATA_MODULES
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        )
        if not allowed:
            raise pickle.UnpicklingError(f"it references {module}.{name}, which a checkpoint's metadata never needs")
        return super().find_class(module, name)


def check_dist_checkpoint(directory: str | Path) -> None:
    """ValueError naming the file unless the checkpoint's pickles hold only checkpoint data."""
    directory = Path(directory)
    metadata = directory / ".metadata"
    if not metadata.is_file():
        raise ValueError(f"{directory} has no .metadata: pass a torch_dist checkpoint")
    try:
        _MetadataUnpickler(io.BytesIO(metadata.read_bytes())).load()
    except Exception as error:  # noqa: BLE001 - any failure means: do not let torch unpickle it
        raise ValueError(
            f"{metadata}: refused ({error}); load only checkpoints you trust, or convert from HF safetensors instead"
        ) from None
    common = directory / "common.pt"
    if common.is_file():
        try:
            torch.load(common, map_location="cpu", weights_only=True)
        except Exception as error:  # noqa: BLE001
            raise ValueError(f"{common}: refused, it does not load with weights_only=True ({error})") from None
