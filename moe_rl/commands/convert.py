"""`moe-rl convert hf-to-megatron | megatron-to-hf | peft-to-megatron | megatron-to-peft`:
checkpoint conversion through the bridges (`moe_rl.conversion`: the checks and the rank functions;
this module parses the arguments and starts the ranks).

hf-to-megatron: every rank builds its stage of the Megatron model for the requested layout,
reads only its slices of the HF safetensors, and all ranks write one Megatron
dist_checkpointing (torch_dist) checkpoint of `model.sharded_state_dict()` (plain keys, no
prefix: load it with `dist_checkpointing.load(model.sharded_state_dict(), dir)` at any layout)
plus `moe_rl_meta.json` (the HF config) and the HF side files (tokenizer, generation config)
under `hf_files/`.
megatron-to-hf: loads such a checkpoint at any layout, streams the HF tensors out of each
pipeline stage and writes safetensors shards + index + config that
`transformers.AutoModelForCausalLM.from_pretrained` loads.

peft-to-megatron: a PEFT LoRA adapter of an HF model (`--peft`, `--hf` the base model directory or
just its config.json) -> a torch_dist checkpoint of the Megatron adapters (`parallel.lora`) plus
`moe_rl_meta.json` (HF config and `lora:` settings). megatron-to-peft: such a checkpoint, or a LoRA
trainer checkpoint of `moe-rl train` (which holds only the adapters), -> a PEFT adapter directory
(`parallel.peft`) for SGLang, vLLM or PEFT. Only adapters move: no base weights are read.

Runs as spawned gloo ranks on one machine, or joins the world under torchrun
(`scripts/convert_*.sh`). Output goes to `<out>.tmp` and is renamed to `<out>` when complete.
Nothing a user has is lost: an output that equals or contains the input is refused, and so is an
existing non-empty output (or `<out>.tmp`) unless `--overwrite` is given.
"""

from __future__ import annotations

import math
from pathlib import Path

from moe_rl.conversion.checks import check_before_launch, check_output
from parallel.layout import ParallelLayout

COMMAND = ("convert",)
HELP = "convert checkpoints between HF safetensors and Megatron dist_checkpointing"


def add_arguments(parser) -> None:
    directions = parser.add_subparsers(dest="direction", required=True)
    to_megatron = directions.add_parser("hf-to-megatron", help="HF safetensors -> Megatron torch_dist")
    to_megatron.add_argument("--hf", required=True, help="HF model directory (config.json + safetensors)")
    to_megatron.add_argument(
        "--mtp",
        choices=["drop"],
        default=None,
        help="leave out the multi-token-prediction layers (DeepSeek-V3, GLM-4.5)",
    )
    to_hf = directions.add_parser("megatron-to-hf", help="Megatron torch_dist -> HF safetensors")
    to_hf.add_argument("--megatron", required=True, help="checkpoint written by hf-to-megatron")
    to_hf.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors file")
    to_hf.add_argument("--bucket-mb", type=float, default=512, help="export gather bucket size")
    to_hf.add_argument(
        "--fp8-blocks",
        type=int,
        default=None,
        metavar="N",
        help="write decoder linear weights as FP8 e4m3 in N x N blocks with weight_scale_inv, "
        "as DeepSeek-V3 ships (N=128), for engines that serve FP8",
    )
    from_peft = directions.add_parser("peft-to-megatron", help="PEFT LoRA adapter -> Megatron torch_dist adapters")
    from_peft.add_argument("--peft", required=True, help="adapter directory (adapter_config.json + safetensors)")
    from_peft.add_argument("--hf", required=True, help="the base model's HF directory (config.json is enough)")
    to_peft = directions.add_parser("megatron-to-peft", help="Megatron adapters -> PEFT LoRA adapter")
    to_peft.add_argument(
        "--megatron", required=True, help="checkpoint written by peft-to-megatron, or a LoRA trainer checkpoint"
    )
    for sub in (to_megatron, to_hf, from_peft, to_peft):
        sub.add_argument("--out", required=True, help="output directory (written when complete)")
        sub.add_argument(
            "--overwrite",
            action="store_true",
            help="replace an existing non-empty --out (never one that holds the input)",
        )
        for axis in ("tp", "pp", "ep"):
            sub.add_argument(f"--{axis}", type=int, default=1, help=f"{axis.upper()} size of the conversion world")
        sub.add_argument("--etp", type=int, default=None, help="expert TP size (default: --tp)")
        sub.add_argument(
            "--world-size",
            type=int,
            default=None,
            help="ranks to spawn when not under torchrun (default: the smallest that fits)",
        )


def run(args) -> int:
    # heavy: torch (the conversion ranks); the CLI imports every command module to build its parser
    from moe_rl.conversion.ranks import hf_to_megatron, megatron_to_hf, megatron_to_peft, peft_to_megatron
    from parallel.world import init_distributed, is_first_process, launched_by_torchrun, spawn

    for axis in ("tp", "pp", "ep", "etp", "world_size"):
        value = getattr(args, axis)
        if value is not None and value < 1:
            raise ValueError(f"--{axis.replace('_', '-')}={value}: must be a positive integer")
    etp = args.etp or args.tp
    if launched_by_torchrun():
        world_size = init_distributed()[1]
    else:
        world_size = args.world_size or math.lcm(args.tp, args.ep * etp) * args.pp
    layout = ParallelLayout(
        world_size=world_size, tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp, sequence_parallel=args.tp > 1
    )
    extra = ()
    if args.direction == "hf-to-megatron":
        fn, source = hf_to_megatron, args.hf
        extra = (args.mtp == "drop",)
    elif args.direction == "megatron-to-hf":
        fn, source = megatron_to_hf, args.megatron
        if args.fp8_blocks is not None and args.fp8_blocks < 1:
            raise ValueError(f"--fp8-blocks={args.fp8_blocks}: must be a positive block size, e.g. 128")
        extra = (int(args.max_shard_gb * 2**30), int(args.bucket_mb * 2**20), args.fp8_blocks)
    elif args.direction == "peft-to-megatron":
        fn, source = peft_to_megatron, args.peft
        extra = (args.hf,)
    else:
        fn, source = megatron_to_peft, args.megatron
    if not Path(source).is_dir():
        raise ValueError(f"{source} is not a directory: pass an existing checkpoint")
    check_output(source, args.out, args.overwrite)
    check_before_launch(args.direction, source, layout, drop_mtp=getattr(args, "mtp", None) == "drop")
    if launched_by_torchrun():  # every rank checked before rank 0 creates <out>.tmp
        # heavy: torch, as above
        import torch.distributed as dist

        dist.barrier()
    if launched_by_torchrun():
        fn(layout, source, args.out, *extra)
    else:
        spawn(fn, world_size, layout, source, args.out, *extra)
    if is_first_process():
        print(f"wrote {args.out}")
    return 0
