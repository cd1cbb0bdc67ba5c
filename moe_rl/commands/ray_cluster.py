"""`moe-rl ray address | demand CONFIG [a.b=value ...] | wait --nodes N`: what a launch script
(`scripts/slurm/train.sbatch`) asks before it starts Ray on a cluster and runs `moe-rl train`.

address: this node's address for the other nodes and the interface holding it (`IP IFACE`; never a
loopback address when the node has another). demand: the logical CPUs and GPUs an RL run asks Ray
for (`CPUS GPUS`, `moe_rl.rl.cluster.ray_demand`); a bad config fails here, before Ray starts.
wait: block until N nodes joined the Ray cluster at `--address` (default RAY_ADDRESS).
"""

from __future__ import annotations

import argparse
import os

COMMAND = ("ray",)
HELP = "what a cluster launch needs: this node's address, the run's Ray CPUs and GPUs, waiting for N nodes"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True)
    actions.add_parser("address", help="print this node's address for other nodes and its interface: IP IFACE")
    demand = actions.add_parser("demand", help="print the logical CPUs and GPUs an RL run asks Ray for: CPUS GPUS")
    demand.add_argument("config", help="YAML run config with a rollout section")
    demand.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.world_size=8")
    wait = actions.add_parser("wait", help="wait until N nodes joined the Ray cluster at RAY_ADDRESS")
    wait.add_argument("--nodes", type=int, required=True, help="how many nodes must be alive")
    wait.add_argument("--address", default=None, help="the Ray head's HOST:PORT (default: RAY_ADDRESS)")
    wait.add_argument("--timeout", type=float, default=600.0, help="seconds before giving up")


def run(args: argparse.Namespace) -> int:
    # heavy: Ray; the CLI imports every command module to build its parser
    from moe_rl.rl.ray_init import node_address, wait_for_nodes

    if args.action == "address":
        print(*node_address())
    elif args.action == "demand":
        # heavy: torch, and the RL cluster's actors, as above
        import torch

        from moe_rl.config import load_config
        from moe_rl.rl.cluster import ray_demand

        need = ray_demand(load_config(args.config, args.overrides), torch.cuda.is_available())
        print(need.cpus, need.gpus)
    else:
        address = args.address or os.environ.get("RAY_ADDRESS")
        if not address:
            raise ValueError("ray wait: pass --address HOST:PORT or set RAY_ADDRESS")
        print(f"ray: {wait_for_nodes(address, args.nodes, args.timeout)} nodes alive at {address}")
    return 0
