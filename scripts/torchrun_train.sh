#!/usr/bin/env bash
# Trainer-only run (`moe-rl train` on a config without a rollout section: the supervised job) under
# torchrun; world size = NPROC x NNODES must equal the config's trainer.world_size.
#   NPROC=8 scripts/torchrun_train.sh configs/smoke_cpu.yaml trainer.world_size=8
#   srun --nodes=2 --ntasks-per-node=1 scripts/torchrun_train.sh CONFIG trainer.world_size=16
set -euo pipefail
# shellcheck source=scripts/torchrun_env.sh
source "$(dirname "$0")/torchrun_env.sh"
[[ $# -ge 1 ]] || { echo "usage: $0 CONFIG [dotted.override=value ...]" >&2; exit 2; }
exec "${TORCHRUN[@]}" -m moe_rl.cli train "$@"
