#!/usr/bin/env bash
# The GPU tiers on one CUDA machine (docs/gpu-check.md): install, then every tier whose
# packages are present (tests/gpu_tiers.py), within PYTEST_TOTAL_S (540) s, PYTEST_TEST_S (300) s a test.
#
#   scripts/gpu_check.sh                 fresh venv (.venv-gpu, or GPU_CHECK_VENV) from the package
#                                        index: CUDA torch, moe-rl[dev,sglang,te]
#   scripts/gpu_check.sh --wheels DIR    fresh venv from DIR only (pip --no-index --find-links DIR; make
#                                        DIR with scripts/gpu_wheels.sh on a connected machine)
#   scripts/gpu_check.sh --system [--wheels DIR]
#                                        the Python it runs with (GPU_CHECK_PYTHON, else python3): its own
#                                        torch is kept; moe-rl is installed editable, and only what that
#                                        environment lacks comes from DIR
#   --install-only                       install and report the tiers, run no test (no GPU needed)
#
# With --wheels or --system no step reaches the network. SGLang and Transformer Engine are installed
# only where DIR holds their wheels; the `gpu` tier needs neither.
# Exit status: 0 every runnable tier passed, 2 no GPU, 3 an install step failed (the message names
# the missing package), otherwise pytest's (124: the total time limit was hit).
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS="" SYSTEM=0 INSTALL_ONLY=0
while (($#)); do
  case $1 in
    --wheels) WHEELS=${2:?"--wheels needs a folder of wheels"}; shift 2 ;;
    --system) SYSTEM=1; shift ;;
    --install-only) INSTALL_ONLY=1; shift ;;
    *) echo "gpu_check: unknown argument $1 (usage: scripts/gpu_check.sh [--wheels DIR] [--system] [--install-only])" >&2
       exit 64 ;;
  esac
done
fail() { echo "gpu_check: $1" >&2; exit "${2:-3}"; }
if [[ -n $WHEELS ]]; then
  [[ -d $WHEELS ]] || fail "--wheels $WHEELS: no such folder; make it with scripts/gpu_wheels.sh on a connected machine"
  WHEELS=$(cd "$WHEELS" && pwd)
  compgen -G "$WHEELS/*.whl" >/dev/null || fail "--wheels $WHEELS holds no *.whl file; make it with scripts/gpu_wheels.sh"
fi

# Before anything is installed: without a GPU there is nothing to check.
if ((!INSTALL_ONLY)); then
  if ! command -v nvidia-smi >/dev/null 2>&1 || ! GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1) \
      || [[ -z $GPU ]]; then
    fail "no CUDA GPU here (nvidia-smi missing or it sees no GPU); run this on a GPU machine" 2
  fi
else
  GPU="(not checked: --install-only)"
fi

LOG=$(mktemp -d)
trap 'rm -rf "$LOG"' EXIT
# pip, offline where asked: the missing package is named from pip's own error line.
pip_install() {
  if ! "$PY" -m pip install --disable-pip-version-check -q "$@" >"$LOG/pip.log" 2>&1; then
    local missing
    missing=$(sed -n 's/.*No matching distribution found for \([^ ]*\).*/\1/p' "$LOG/pip.log" | head -n 1)
    if [[ -n $missing ]]; then
      fail "no wheel for '$missing' in ${WHEELS:-this environment (--system without --wheels)}: add it with scripts/gpu_wheels.sh (or pip download it) on a connected machine"
    fi
    tail -n 20 "$LOG/pip.log" >&2
    fail "pip install $* failed (its output above)"
  fi
}

if [[ -n $WHEELS || $SYSTEM == 1 ]]; then
  export PIP_NO_INDEX=1 PIP_INDEX_URL=http://offline.invalid/simple  # no step may reach the network
  [[ -n $WHEELS ]] && export PIP_FIND_LINKS=$WHEELS
  echo "gpu_check: offline install (pip --no-index${WHEELS:+ --find-links $WHEELS}); nothing is fetched"
fi

if ((SYSTEM)); then
  PY=${GPU_CHECK_PYTHON:-$(command -v python3)}
  TORCH=$("$PY" -c "import torch; print(torch.__version__)" 2>/dev/null) \
    || fail "--system: $PY has no torch; install the cluster's CUDA torch there, or use --wheels DIR without --system"
  echo "gpu_check: $GPU; this environment's $("$PY" --version), torch $TORCH (kept)"
  echo "torch==$TORCH" >"$LOG/keep-torch.txt"  # pip may add what is missing, never replace this torch
  pip_install 'setuptools>=68'
  pip_install --no-build-isolation --constraint "$LOG/keep-torch.txt" -e '.[dev]'
else
  PYTHON=${GPU_CHECK_PYTHON:-$(command -v python3.12 || command -v python3)}
  VENV=${GPU_CHECK_VENV:-.venv-gpu}
  echo "gpu_check: $GPU; fresh venv $VENV with $("$PYTHON" --version)"
  "$PYTHON" -m venv --clear "$VENV"
  PY="$VENV/bin/python"
  if [[ -n $WHEELS ]]; then
    pip_install 'setuptools>=68'
    pip_install torch
    pip_install --no-build-isolation -e '.[dev]'
    for extra in sglang transformer_engine; do  # optional tiers: only from wheels that are there
      if compgen -G "$WHEELS/${extra}-*.whl" >/dev/null; then pip_install "$extra"; fi
    done
  else
    "$PY" -m pip install -q --upgrade pip
    "$PY" -m pip install -q torch  # the default index's CUDA build
    "$PY" -m pip install -q -e '.[dev,sglang,te]'
  fi
fi

# The tiers this environment can run; the others are reported as not run, never as passed.
"$PY" -m tests.gpu_tiers | tee "$LOG/tiers.txt"
mapfile -t READY < <(awk '$2 == "ready" {print $1}' "$LOG/tiers.txt")
if ((INSTALL_ONLY)); then
  echo "gpu_check: installed (--install-only); tiers ready here: ${READY[*]:-none}"
  exit 0
fi
((${#READY[@]})) || fail "no tier can run here (see above)" 5
MARKERS=$(printf ' or %s' "${READY[@]}")
MARKERS=${MARKERS# or }

TOTAL_S=${PYTEST_TOTAL_S:-540}
TEST_S=${PYTEST_TEST_S:-300}
export MOE_RL_GPU_METRICS="$PWD/benchmarks/gpu_metrics.json"  # what the tier measures (moe-rl plan reads it)
set +e
timeout "$TOTAL_S" "$PY" -m pytest -m "$MARKERS" -q -rA --timeout "$TEST_S" --junitxml "$LOG/gpu.xml" tests
STATUS=$?
set -e

echo "---- gpu_check summary ----"
echo "GPU: $GPU"
"$PY" - "$LOG/gpu.xml" "$LOG/tiers.txt" "$MOE_RL_GPU_METRICS" <<'EOF'
import json
import sys
import xml.etree.ElementTree as ET
from importlib.metadata import PackageNotFoundError, version

def installed(name):
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"

report, tiers, metrics = sys.argv[1:]
print(", ".join(f"{n} {installed(n)}" for n in ("torch", "megatron-core", "sglang", "transformer-engine")))
for line in open(tiers):
    tier, state, *why = line.split(maxsplit=2)
    print(f"tier {tier}: " + ("run" if state == "ready" else f"NOT RUN ({why[0].strip() if why else ''})"))
try:
    suite = ET.parse(report).getroot()
except (OSError, ET.ParseError):
    print("tests: no report (pytest was stopped before it finished)")
    sys.exit()
suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
total, failed = int(suite.get("tests")), int(suite.get("failures")) + int(suite.get("errors"))
skipped = int(suite.get("skipped"))
print(f"tests: {total - failed - skipped} passed, {failed} failed, {skipped} skipped")
try:
    for name, value in json.load(open(metrics)).get("measured", {}).items():
        print(f"measured: {name} = {value['value']:.4g} {value['unit']}")
except (OSError, ValueError):
    print("measured: nothing (no metrics file)")
EOF
case $STATUS in
  0) echo "gpu_check: passed (tiers run: ${READY[*]})" ;;
  124) echo "gpu_check: FAILED, the tests ran past ${TOTAL_S} s" ;;
  5) echo "gpu_check: FAILED, no test of the ready tiers was collected" ;;
  *) echo "gpu_check: FAILED (pytest exit status $STATUS)" ;;
esac
exit "$STATUS"
