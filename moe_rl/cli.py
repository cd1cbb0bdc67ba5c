"""`moe-rl` command line: every module in `moe_rl.commands` adds one (sub)command.

A command module defines `COMMAND` (a tuple of words, e.g. ("bench", "sync")), `HELP`,
`add_arguments(parser)` and `run(args) -> int | None`. Modules are found by listing the
package, so adding a command is adding a file.

User code that a config names (`rollout.task`, `rollout.reward`, `rollout.agent` as
`package.module:name`) imports from PYTHONPATH or from the directory moe-rl runs in, as under
`python -m`: `main` puts that directory on `sys.path` (last, so it never shadows an installed
package), and Ray puts the driver's working directory on every worker's `sys.path`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys

from moe_rl import commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-rl", description=__doc__.splitlines()[0])
    groups: dict[tuple[str, ...], argparse._SubParsersAction] = {
        (): parser.add_subparsers(dest="command", required=True)
    }
    parsers: dict[tuple[str, ...], argparse.ArgumentParser] = {}
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        words = tuple(module.COMMAND)
        for depth in range(1, len(words)):  # parents such as `bench` in `bench sync`
            prefix = words[:depth]
            if prefix not in groups:
                sub = groups[words[: depth - 1]].add_parser(prefix[-1], help=f"{prefix[-1]} commands")
                parsers[prefix] = sub
                groups[prefix] = sub.add_subparsers(dest="_".join(prefix), required=True)
        leaf = groups[words[:-1]].add_parser(words[-1], help=module.HELP, description=module.HELP)
        module.add_arguments(leaf)
        leaf.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        return int(args._run(args) or 0)
    except ValueError as error:  # user errors: one clear line, no traceback
        print(f"moe-rl: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
