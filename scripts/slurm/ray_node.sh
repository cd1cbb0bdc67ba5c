#!/usr/bin/env bash
# One Ray node of a SLURM job, run by train.sbatch as a background job step:
#   ray_node.sh TEMP_DIR [ray start options...]
# `ray start --block` with the job's own temp dir (so no later `ray.init` on the node finds this
# cluster's address file), removed when the step ends. A signal to a step reaches every process
# in it, so Ray's processes inherit USR1 and USR2 ignored: a USR1 sent to the whole job (`scancel
# --signal=USR1 JOBID`) never stops Ray while the driver checkpoints. train.sbatch stops this node
# with USR2 to its srun once the driver has exited (srun forwards USR1/USR2; TERM or HUP to srun
# SIGKILL the step, leaving the temp dir). A TERM from SLURM itself (scancel, the time limit)
# stops Ray's processes directly (they handle it) and this script with them: a clean exit.
set -uo pipefail
TMP=$1
shift
export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0   # no Serve traffic to drain: stop at once
trap 'rm -rf "$TMP"' EXIT
trap '' USR1
trap 'kill -TERM "$RAY" 2>/dev/null; wait "$RAY"; exit 0' USR2 TERM INT
(trap '' USR2; exec ray start --temp-dir="$TMP" --block "$@") &
RAY=$!
wait "$RAY"
