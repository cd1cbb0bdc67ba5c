"""`moe-rl engines add RUN_DIR N | remove RUN_DIR NAME | list RUN_DIR`: grow, shrink or show a
running RL job's rollout engines, through the run directory (`moe_rl.rl.control`; what add and
remove guarantee: `moe_rl.rl.fleet`)."""

from __future__ import annotations

import sys

from moe_rl.rl.control import DriverUnavailable, FleetAnswer, FleetRequest, send

COMMAND = ("engines",)
HELP = "add, remove or list the rollout engines of a running RL job (its driver answers through RUN_DIR/control)"


def add_arguments(parser) -> None:
    actions = parser.add_subparsers(dest="action", required=True)
    add = actions.add_parser("add", help="start N engines; returns once they serve the current weights")
    add.add_argument("run_dir", help="the run's output_dir (shared with this node)")
    add.add_argument("count", type=int, metavar="N", help="engines to add (>= 1)")
    remove = actions.add_parser("remove", help="take an engine out; its requests continue on the others")
    remove.add_argument("run_dir", help="the run's output_dir (shared with this node)")
    remove.add_argument("name", metavar="NAME", help="the engine, as `moe-rl engines list` names it (engine-1)")
    show = actions.add_parser("list", help="the run's engines: state, requests in flight and served, versions")
    show.add_argument("run_dir", help="the run's output_dir (shared with this node)")
    for sub in (add, remove, show):
        sub.add_argument(
            "--timeout",
            type=float,
            default=600.0,
            help="seconds to wait for the driver's answer (default 600: it reads requests between training steps)",
        )


def run(args) -> int:
    request = FleetRequest(args.action, count=getattr(args, "count", 0), name=getattr(args, "name", ""))
    try:
        answer = send(args.run_dir, request, args.timeout, on_accepted=lambda a: print(f"accepted: {a.message}"))
    except DriverUnavailable as error:
        print(f"moe-rl: error: {error}", file=sys.stderr)
        return 1
    if answer.state == "failed":
        print(f"moe-rl: error: {answer.message}", file=sys.stderr)
        return 2
    if request.action != "list":
        took = f" ({answer.seconds:.1f} s)" if answer.seconds is not None else ""
        print(f"{answer.message}{took}")
    print(format_engines(answer))
    return 0


def format_engines(answer: FleetAnswer) -> str:
    rows = [f"weight version {answer.version}", f"{'engine':<12}{'state':<12}{'in flight':>10}{'served':>8}  versions"]
    for engine in answer.engines:
        versions = engine.get("versions")
        span = f"v{versions[0]}..v{versions[1]}" if versions else "-"
        in_flight, served = engine.get("in_flight", "-"), engine.get("served", "-")
        rows.append(f"{engine['name']:<12}{engine['state']:<12}{in_flight:>10}{served:>8}  {span}")
    return "\n".join(rows)
