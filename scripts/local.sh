#!/usr/bin/env bash
# One machine (a workstation, one GPU node, or CPU only): `moe-rl train` starts its own Ray.
#   scripts/local.sh configs/demo_cpu.yaml
#   scripts/local.sh configs/models/qwen3_30b_a3b.yaml cluster.nodes=1 ...   (GPU node: planned first)
# Pass --resume RUN_DIR (before the config) to continue a stopped run.
set -euo pipefail
cd "$(dirname "$0")/.."
[[ -f .venv/bin/activate ]] && source .venv/bin/activate
[[ $# -ge 1 ]] || { echo "usage: $0 [--resume RUN_DIR] CONFIG [dotted.override=value ...]" >&2; exit 2; }
unset RAY_ADDRESS   # never join a cluster by accident (moe-rl train starts its own, token-protected)
RESUME=()
if [[ $1 == --resume ]]; then
  RESUME=(--resume "$2")
  shift 2
fi
if grep -q '^cluster:' "$1"; then
  moe-rl plan "$@"
fi
exec moe-rl train "${RESUME[@]}" "$@"
