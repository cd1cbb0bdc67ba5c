"""`moe-rl eval CONFIG --checkpoint DIR [a.b=value ...]`: evaluate a saved policy on the config's
`eval:` datasets (`moe_rl.jobs.evaluate`), print a table of the metrics and write them, with every
sample, into `--output` (default: `<checkpoint>_eval`)."""

from __future__ import annotations

from pathlib import Path

COMMAND = ("eval",)
HELP = "evaluate a saved HF or Megatron checkpoint on the config's eval datasets (pass@k, dumps)"


def add_arguments(parser) -> None:
    parser.add_argument("config", help="YAML run config with an eval: section")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.temperature=0.6")
    parser.add_argument("--checkpoint", required=True, help="HF model directory or `moe-rl convert` checkpoint")
    parser.add_argument("--output", help="where metrics and samples go (default: <checkpoint>_eval)")
    parser.add_argument("--step", type=int, default=0, help="the step the metrics rows carry (e.g. the checkpoint's)")


def run(args) -> int:
    # heavy: torch (through moe_rl.config); the CLI imports every command module to build its parser
    from rich.console import Console
    from rich.table import Table

    from moe_rl.config import load_config
    from moe_rl.jobs import evaluate
    from moe_rl.jobs.preflight import check_eval

    config = load_config(args.config, args.overrides)
    if config.eval is None:
        raise ValueError(f"{args.config}: no eval section; add eval.datasets ({{name, path}}), see docs/recipes.md")
    check_eval(config)
    output = Path(args.output or f"{str(args.checkpoint).rstrip('/')}_eval")
    results = evaluate.run(config, args.checkpoint, output, args.step)
    table = Table("metric", "value", title=f"{args.checkpoint} (step {args.step})")
    for result in results:
        for key, value in result.metrics.items():
            table.add_row(key, f"{value:.4g}")
    Console().print(table)
    print(f"metrics: {output / 'metrics.jsonl'}; samples: moe-rl samples {output} --eval NAME --step {args.step}")
    return 0
