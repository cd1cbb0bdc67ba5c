"""One module per `moe-rl` command; see `moe_rl.cli`. `options_from` builds a command's typed
options object from its parsed arguments."""

from __future__ import annotations

import argparse
import dataclasses
from typing import TypeVar

Options = TypeVar("Options")


def options_from(cls: type[Options], args: argparse.Namespace) -> Options:
    """`cls` (a dataclass) from the parsed arguments named as its fields (`--max-new-tokens` ->
    `max_new_tokens`); a field the command has no argument for keeps its default."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})
