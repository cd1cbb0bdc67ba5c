"""`moe-rl report RUN_DIR`: PNG plots (reward, staleness, routing agreement, time) into RUN_DIR/plots."""

from __future__ import annotations

from moe_rl.report import write_report

COMMAND = ("report",)
HELP = "write PNG plots of a run directory's metrics into RUN_DIR/plots"


def add_arguments(parser) -> None:
    parser.add_argument("run_dir", help="a run directory written by `moe-rl train` (has metrics.jsonl)")


def run(args) -> int:

    for path in write_report(args.run_dir):
        print(path)
    return 0
