"""`moe-rl train CONFIG [a.b=value ...]`: validate the config, then run its job.

A config with a `rollout:` section runs the RL job (`moe_rl.jobs.rl`: Ray actors for the trainer
world, the engines and the rollout manager); otherwise the supervised job runs on a trainer
world, spawned as gloo ranks on one machine or joined under torchrun. The config is fully
validated (layout vs model included) before any process starts.
"""

from __future__ import annotations

COMMAND = ("train",)
HELP = "train a model from a YAML config (dotted overrides: trainer.tp=2); RL when it has a rollout section"


def add_arguments(parser) -> None:
    parser.add_argument("config", help="YAML run config (see configs/)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.tp=2 steps=20")


def run(args) -> int:
    from moe_rl.config import load_config

    config = load_config(args.config, args.overrides)
    if config.is_rl:
        from moe_rl.jobs import rl

        summary = rl.run(config)
        print(f"reward {summary['reward_first']:.3f} -> {summary['reward_last']:.3f} over {config.steps} steps "
              f"({config.rl.mode}); {summary['wall_s']:.0f} s wall ({summary['setup_s']:.0f} s start-up); "
              f"run dir: {config.output_dir}")
        return 0
    from moe_rl.jobs import supervised
    from parallel.world import init_distributed, launched_by_torchrun, spawn

    if launched_by_torchrun():
        init_distributed()
        losses = supervised.run(config)
    else:
        losses = spawn(supervised.run, config.trainer.world_size, config, timeout_s=None)[0]
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps; run dir: {config.output_dir}")
    return 0
