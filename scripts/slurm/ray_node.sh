#!/usr/bin/env bash
# One Ray node of a SLURM job, run by train.sbatch as a background job step:
#   ray_node.sh TEMP_DIR [ray start options...]
# `ray start --block` with the job's own temp dir (so no later `ray.init` on the node finds this
# cluster's address file), removed when the step ends. Stopped by SIGUSR1 (train.sbatch signals
# its srun, which forwards USR1 to this task; a SIGTERM to srun would SIGKILL the step instead,
# leaving the temp dir) or by SIGTERM (scancel, the time limit): these daemons only, a clean exit.
set -uo pipefail
TMP=$1
shift
trap 'rm -rf "$TMP"' EXIT
trap 'kill -TERM "$RAY" 2>/dev/null; wait "$RAY"; exit 0' TERM INT USR1
ray start --temp-dir="$TMP" --block "$@" &
RAY=$!
wait "$RAY"
