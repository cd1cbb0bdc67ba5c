"""Directories written whole or not at all: write into a staging directory beside the final one,
then rename it into place. A crash leaves at most the staging directory (the next writer
empties it), never a half-written directory under the final name.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def staging_dir(final: str | os.PathLike, hidden: bool = False) -> Path:
    """`<final>.tmp`, or `.tmp-<name>` (`hidden`: where readers list the parent, e.g. engines
    scanning an adapter directory, and must not see it)."""
    final = Path(final)
    return final.with_name(f".tmp-{final.name}" if hidden else f"{final.name}.tmp")


def fresh_staging(final: str | os.PathLike, hidden: bool = False) -> Path:
    """The staging directory of `final`, emptied and created."""
    staging = staging_dir(final, hidden)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def publish(staging: str | os.PathLike, final: str | os.PathLike) -> Path:
    """Move the complete `staging` to `final`, replacing what was there."""
    final = Path(final)
    shutil.rmtree(final, ignore_errors=True)
    Path(staging).rename(final)
    return final
