"""`moe-rl stacks RUN_DIR [NAME ...]`: the Python stacks of a running RL job's processes on this node."""

from __future__ import annotations

COMMAND = ("stacks",)
HELP = "print every process's Python stacks of a running RL job (py-spy if installed, else faulthandler)"


def add_arguments(parser) -> None:
    parser.add_argument("run_dir", help="the output_dir of a running `moe-rl train` (has processes.json)")
    parser.add_argument("names", nargs="*", help="only these processes, e.g. 'trainer rank 1' (default: all)")


def run(args) -> int:

    from moe_rl.rl.stacks import dump_stacks

    print(dump_stacks(args.run_dir, set(args.names) or None))
    return 0
