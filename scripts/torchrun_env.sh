# Sourced by scripts/torchrun_*.sh: torchrun's node settings from SLURM, or one node by default.
#   NPROC (GPUs per node), NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT may be set by hand.
# Multi-node NCCL/InfiniBand settings (NCCL_IB_HCA, NCCL_SOCKET_IFNAME, NCCL_DEBUG): see
# scripts/slurm/train.sbatch.
NPROC=${NPROC:-${SLURM_GPUS_ON_NODE:-$(nvidia-smi -L 2>/dev/null | wc -l)}}
[[ ${NPROC:-0} -ge 1 ]] || NPROC=1
NNODES=${NNODES:-${SLURM_NNODES:-1}}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "${SLURM_JOB_NODELIST:-}" 2>/dev/null | head -n1)}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-29511}
export CUDA_DEVICE_MAX_CONNECTIONS=1
TORCHRUN=(torchrun --nproc-per-node="$NPROC" --nnodes="$NNODES" --node-rank="$NODE_RANK"
          --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT")
