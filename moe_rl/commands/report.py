"""`moe-rl report RUN_DIR [RUN_DIR...]`: PNG plots (reward, staleness, routing agreement, time) into
each RUN_DIR/plots; with several runs, their speculative curves side by side too (`write_comparison`)."""

from __future__ import annotations

from moe_rl.report import write_comparison, write_report

COMMAND = ("report",)
HELP = "write PNG plots of a run directory's metrics into RUN_DIR/plots"


def add_arguments(parser) -> None:
    parser.add_argument("run_dir", nargs="+", help="run directories written by `moe-rl train` (each has metrics.jsonl)")


def run(args) -> int:
    for run_dir in args.run_dir:
        for path in write_report(run_dir):
            print(path)
    if len(args.run_dir) > 1 and (compared := write_comparison(args.run_dir)) is not None:
        print(compared)
    return 0
