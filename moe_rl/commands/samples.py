"""`moe-rl samples RUN_DIR [--step N] [--worst | --best] [--limit K] [--eval NAME]`: a step's dumped samples."""

from __future__ import annotations

from moe_rl.rollout.dump_view import show_step

COMMAND = ("samples",)
HELP = "print a step's samples (rollout.dump: true) with reward, advantage, staleness, versions and texts"


def add_arguments(parser) -> None:
    parser.add_argument("run_dir", help="a run directory written by `moe-rl train` with rollout.dump: true")
    parser.add_argument("--step", type=int, default=None, help="the step to show (default: the newest)")
    order = parser.add_mutually_exclusive_group()
    order.add_argument("--worst", action="store_const", const="worst", dest="order", help="lowest reward first")
    order.add_argument("--best", action="store_const", const="best", dest="order", help="highest reward first")
    parser.add_argument("--limit", type=int, default=8, help="samples shown (default 8)")
    parser.add_argument("--eval", dest="eval_name", default=None, help="read RUN_DIR/eval/NAME/ instead of rollouts/")


def run(args) -> int:
    show_step(args.run_dir, step=args.step, order=args.order, limit=args.limit, eval_name=args.eval_name)
    return 0
