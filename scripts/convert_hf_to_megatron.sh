#!/usr/bin/env bash
# HF safetensors -> Megatron torch_dist checkpoint, on one node or a SLURM allocation.
#   NPROC=8 scripts/convert_hf_to_megatron.sh --hf /ckpt/Qwen3-30B-A3B --out /ckpt/q3-mcore --tp 2 --ep 4
# Under SLURM (srun sets the node list), NNODES / NODE_RANK / MASTER_ADDR come from the allocation.
# The world size (NPROC x NNODES) must be a multiple of the layout (tp*pp and etp*ep*pp).
set -euo pipefail
NPROC=${NPROC:-${SLURM_GPUS_ON_NODE:-1}}
NNODES=${NNODES:-${SLURM_NNODES:-1}}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "${SLURM_JOB_NODELIST:-localhost}" 2>/dev/null | head -n1 || echo localhost)}
MASTER_PORT=${MASTER_PORT:-29511}
exec torchrun --nproc-per-node="$NPROC" --nnodes="$NNODES" --node-rank="$NODE_RANK" \
  --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" \
  -m moe_rl.cli convert hf-to-megatron "$@"
