#!/usr/bin/env bash
# On a connected machine: download the wheel set that `scripts/gpu_check.sh --wheels DIR` installs
# on an air-gapped GPU node (docs/gpu-check.md).
#
#   scripts/gpu_wheels.sh DIR [--python-version 3.12] [--platform manylinux_2_28_x86_64]
#                             [--torch 'torch==2.13.0'] [--with sglang,te]
#
# DIR gets: CUDA torch (the package index's default Linux build) and its nvidia-* wheels, moe-rl's
# dependencies with the `dev` extra (pytest, the oracle packages), setuptools (moe-rl is installed
# editable from the checkout, with no build isolation), and with --with the optional SGLang and
# Transformer Engine stacks. Only binary wheels for the target Python and platform: this machine's
# own Python and OS do not matter. Several GB (CUDA torch and its nvidia-* wheels). Copy DIR with the checkout.
set -euo pipefail
cd "$(dirname "$0")/.."

DIR=${1:?"usage: scripts/gpu_wheels.sh DIR [--python-version X.Y] [--platform TAG] [--torch SPEC] [--with sglang,te]"}
shift
PY_VERSION=3.12 PLATFORM=manylinux_2_28_x86_64 TORCH=torch WITH=""
while (($#)); do
  case $1 in
    --python-version) PY_VERSION=$2; shift 2 ;;
    --platform) PLATFORM=$2; shift 2 ;;
    --torch) TORCH=$2; shift 2 ;;
    --with) WITH=$2; shift 2 ;;
    *) echo "gpu_wheels: unknown argument $1" >&2; exit 64 ;;
  esac
done
mkdir -p "$DIR"

# moe-rl's requirements as pip reads them from pyproject.toml (no build, no network for this step)
mapfile -t REQUIREMENTS < <(python3 - "$WITH" <<'EOF'
import sys
import tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
wanted = ["dev", *filter(None, sys.argv[1].split(","))]  # extras of pyproject.toml: sglang, te
for requirement in project["dependencies"] + [r for extra in wanted for r in extras[extra]]:
    if not requirement.startswith("torch"):
        print(requirement)
print("setuptools>=68")
EOF
)
# pip matches one platform tag per flag: the manylinux generations a current wheel may carry
PLATFORMS=("$PLATFORM" manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64)
echo "gpu_wheels: $TORCH and ${#REQUIREMENTS[@]} requirements for Python $PY_VERSION on $PLATFORM into $DIR"
python3 -m pip download --disable-pip-version-check --only-binary=:all: --python-version "$PY_VERSION" \
  "${PLATFORMS[@]/#/--platform=}" --dest "$DIR" "$TORCH" "${REQUIREMENTS[@]}"
echo "gpu_wheels: $(ls "$DIR"/*.whl | wc -l) wheels, $(du -sh "$DIR" | cut -f1) in $DIR"
echo "gpu_wheels: on the GPU node: scripts/gpu_check.sh --wheels $DIR   (or --system --wheels $DIR)"
