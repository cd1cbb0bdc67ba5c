#!/usr/bin/env bash
# The GPU tier on one CUDA machine: a fresh venv with the GPU extras, then every `gpu`-marked test.
#   scripts/gpu_check.sh            (venv in .venv-gpu; GPU_CHECK_VENV=DIR to put it elsewhere)
# Runs `pytest -m gpu`: the SGLang server and an NCCL weight sync into it
# (tests/engine/test_engine_sglang.py), CUDA-IPC weight sync (tests/sync/test_sync_cuda_ipc.py),
# Transformer Engine layer names (tests/parallel/test_bridge_te_names.py) and an RL run with an
# SGLang engine (tests/rl/test_engine_placement.py), within PYTEST_TOTAL_S (540) seconds, PYTEST_TEST_S (300) a test.
# Exit status: 0 all passed, 2 no GPU, otherwise pytest's (124: the total limit was hit).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v nvidia-smi >/dev/null 2>&1 || ! GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1) \
    || [[ -z $GPU ]]; then
  echo "gpu_check: no CUDA GPU here (nvidia-smi missing or it sees no GPU); run this on a GPU machine" >&2
  exit 2
fi

PYTHON=$(command -v python3.12 || command -v python3)
VENV=${GPU_CHECK_VENV:-.venv-gpu}
TOTAL_S=${PYTEST_TOTAL_S:-540}
TEST_S=${PYTEST_TEST_S:-300}
echo "gpu_check: $GPU; fresh venv $VENV with $($PYTHON --version)"
"$PYTHON" -m venv --clear "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q torch                      # the default index's CUDA build
"$PY" -m pip install -q -e '.[dev,sglang,te]'

REPORT=$(mktemp -d)
trap 'rm -rf "$REPORT"' EXIT
set +e
timeout "$TOTAL_S" "$PY" -m pytest -m gpu -q -rA --timeout "$TEST_S" --junitxml "$REPORT/gpu.xml" tests
STATUS=$?
set -e

echo "---- gpu_check summary ----"
echo "GPU: $GPU"
"$PY" - "$REPORT/gpu.xml" <<'EOF'
import sys
import xml.etree.ElementTree as ET
from importlib.metadata import PackageNotFoundError, version

def installed(name):
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"

print(", ".join(f"{n} {installed(n)}" for n in ("torch", "sglang", "transformer-engine")))
try:
    suite = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError):
    print("tests: no report (pytest was stopped before it finished)")
    sys.exit()
suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
total, failed = int(suite.get("tests")), int(suite.get("failures")) + int(suite.get("errors"))
skipped = int(suite.get("skipped"))
print(f"tests: {total - failed - skipped} passed, {failed} failed, {skipped} skipped")
EOF
case $STATUS in
  0) echo "gpu_check: passed" ;;
  124) echo "gpu_check: FAILED, the tests ran past ${TOTAL_S} s" ;;
  5) echo "gpu_check: FAILED, no gpu-marked test was collected" ;;
  *) echo "gpu_check: FAILED (pytest exit status $STATUS)" ;;
esac
exit "$STATUS"
