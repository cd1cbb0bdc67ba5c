"""What `moe-rl convert` refuses before any rank starts: an output whose writing would destroy
anything, an unknown architecture, a layout that cannot split the model, a checkpoint that is not
one `hf-to-megatron` wrote, an adapter config that cannot load. Each is a ValueError naming the fix.
"""

from __future__ import annotations

import json
from pathlib import Path

from moe_rl.conversion.directory import META_FILE
from parallel.staging import staging_dir


def check_output(source: str, out: str, overwrite: bool) -> None:
    """Refuse an output whose writing would destroy anything: the input (or a folder holding it),
    or, without `overwrite`, an existing non-empty directory or staging folder."""
    source_path, out_path = Path(source).resolve(), Path(out).resolve()
    if source_path == out_path or out_path in source_path.parents:
        raise ValueError(
            f"--out {out} would replace the input {source} (it equals or contains it): choose another output directory"
        )
    for path in (out_path, staging_dir(out_path)):
        if not overwrite and (path.is_file() or (path.is_dir() and any(path.iterdir()))):
            raise ValueError(
                f"--out: {path} exists and is not empty; choose a new directory or pass --overwrite to replace it"
            )


def check_before_launch(direction: str, source: str, layout, drop_mtp: bool) -> None:
    """Unknown architecture or a layout that cannot split the model: ValueError, no ranks started."""
    # heavy: torch (the bridges); the CLI imports `moe-rl convert`, and with it this module, to build its parser
    from moe_rl.conversion.ranks import source_hf_config
    from parallel.bridges import bridge_for
    from parallel.checkpoint_trust import check_dist_checkpoint

    if direction == "hf-to-megatron":
        hf_config = source_hf_config(source, drop_mtp)
    elif direction == "peft-to-megatron":
        # heavy: torch, as above
        from parallel.peft import lora_config_of

        lora_config_of(source)  # a bad adapter config fails here, before any rank starts
        return
    else:
        meta = Path(source) / META_FILE
        if not meta.exists():
            raise ValueError(f"{source} has no {META_FILE}: pass a checkpoint written by hf-to-megatron")
        check_dist_checkpoint(source)  # its pickles, before any rank lets torch unpickle them
        hf_config = json.loads(meta.read_text())["hf_config"]
    layout.check_model(bridge_for(hf_config).model_shape())
