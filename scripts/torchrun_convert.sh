#!/usr/bin/env bash
# Checkpoint conversion under torchrun, either direction (see `moe-rl convert --help`):
#   NPROC=8 scripts/torchrun_convert.sh hf-to-megatron --hf /ckpt/Qwen3-30B-A3B --out /ckpt/q3-mcore --tp 2 --ep 4
#   NPROC=8 scripts/torchrun_convert.sh megatron-to-hf --megatron /ckpt/q3-mcore --out /ckpt/q3-hf
# The world size (NPROC x NNODES) must be a multiple of the layout (tp*pp and etp*ep*pp).
set -euo pipefail
# shellcheck source=scripts/torchrun_env.sh
source "$(dirname "$0")/torchrun_env.sh"
[[ $# -ge 1 ]] || { echo "usage: $0 hf-to-megatron|megatron-to-hf ARGS..." >&2; exit 2; }
exec "${TORCHRUN[@]}" -m moe_rl.cli convert "$@"
