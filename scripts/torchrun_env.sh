# Sourced by scripts/torchrun_*.sh: the environment (VENV, default .venv of this checkout) and
# torchrun's node settings from SLURM, or one node by default.
#   NPROC (processes per node: the node's GPUs, 1 without), NNODES, NODE_RANK, MASTER_ADDR,
#   MASTER_PORT may be set by hand.
# Multi-node NCCL/InfiniBand settings (NCCL_IB_HCA, NCCL_SOCKET_IFNAME, NCCL_DEBUG): see
# scripts/slurm/train.sbatch.
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${VENV:-$REPO/.venv}
# shellcheck disable=SC1091
[[ -f $VENV/bin/activate ]] && source "$VENV/bin/activate"
if ! command -v torchrun >/dev/null; then
  echo "torchrun not found: set VENV to the environment holding moe-rl (default $REPO/.venv: make setup)" >&2
  exit 127
fi
node_gpus() {   # 0 where there is no nvidia-smi
  if command -v nvidia-smi >/dev/null; then nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true; else echo 0; fi
}
first_node() {  # empty outside SLURM
  if [[ -n ${SLURM_JOB_NODELIST:-} ]] && command -v scontrol >/dev/null; then
    scontrol show hostnames "$SLURM_JOB_NODELIST" | awk 'NR == 1'
  fi
}
NPROC=${NPROC:-${SLURM_GPUS_ON_NODE:-$(node_gpus)}}
[[ $NPROC -ge 1 ]] || NPROC=1
NNODES=${NNODES:-${SLURM_NNODES:-1}}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
MASTER_ADDR=${MASTER_ADDR:-$(first_node)}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-29511}
export CUDA_DEVICE_MAX_CONNECTIONS=1
TORCHRUN=(torchrun --nproc-per-node="$NPROC" --nnodes="$NNODES" --node-rank="$NODE_RANK"
          --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT")
