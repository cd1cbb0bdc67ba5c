"""`scripts/gpu_check.sh` on a machine without a GPU: its refusals and its offline install step.

The install step runs for real (a new venv, pip), with the package index pointed at an address
that cannot resolve: whatever pip would fetch from the network fails, so a pass shows that
nothing was fetched. The venv under test sees this suite's own packages through a `.pth` file
(an environment that already has torch, as a cluster's does).
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
OFFLINE = {"PIP_INDEX_URL": "http://offline.invalid/simple", "PIP_NO_CACHE_DIR": "1"}


def run_check(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        env={**os.environ, **OFFLINE, **(env or {})},
        capture_output=True,
        text=True,
        timeout=600,
    )


def wheel_folder(path: Path) -> Path:
    """A wheel folder that holds one small valid wheel (and nothing moe-rl needs)."""
    path.mkdir()
    with zipfile.ZipFile(path / "placeholder-1.0-py3-none-any.whl", "w") as whl:
        whl.writestr("placeholder/__init__.py", "")
        whl.writestr("placeholder-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: placeholder\nVersion: 1.0\n")
        whl.writestr(
            "placeholder-1.0.dist-info/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        whl.writestr("placeholder-1.0.dist-info/RECORD", "")
    return path


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU machine: the check would run")
@pytest.mark.parametrize("mode", [["--wheels"], ["--system", "--wheels"]], ids=["wheels", "system"])
def test_no_gpu_exits_2_before_installing_anything(tmp_path, mode):
    venv = tmp_path / "venv"
    result = run_check(*mode, str(wheel_folder(tmp_path / "wheels")), env={"GPU_CHECK_VENV": str(venv)})
    assert result.returncode == 2, result.stderr
    assert "no CUDA GPU here" in result.stderr
    assert "install" not in result.stdout and not venv.exists()


def test_a_wheel_folder_without_a_package_names_it(tmp_path):
    venv = tmp_path / "venv"
    result = run_check(
        "--install-only",
        "--wheels",
        str(wheel_folder(tmp_path / "wheels")),
        env={"GPU_CHECK_VENV": str(venv), "GPU_CHECK_PYTHON": sys.executable},
    )
    assert result.returncode == 3, result.stdout + result.stderr
    assert "no wheel for 'setuptools>=68'" in result.stderr and "scripts/gpu_wheels.sh" in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_arguments_are_named_before_any_work(tmp_path):
    result = run_check("--wheels", str(tmp_path / "absent"))
    assert result.returncode == 3 and "no such folder" in result.stderr
    (tmp_path / "empty").mkdir()
    result = run_check("--wheels", str(tmp_path / "empty"))
    assert result.returncode == 3 and "holds no *.whl" in result.stderr


def test_system_install_is_offline_and_keeps_the_environments_torch(tmp_path):
    """--system in an environment that has every dependency: moe-rl goes in editable, nothing
    else is installed and nothing is fetched; the tiers are reported, none as run."""
    venv = tmp_path / "cluster-env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    site = Path(
        subprocess.check_output(
            [venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
    )
    (site / "suite_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    before, suite_before = set(os.listdir(site)), set(os.listdir(sysconfig.get_paths()["purelib"]))
    result = run_check(
        "--system",
        "--install-only",
        "--wheels",
        str(wheel_folder(tmp_path / "wheels")),
        env={"GPU_CHECK_PYTHON": str(venv / "bin" / "python")},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "offline install" in result.stdout and "torch" in result.stdout and "(kept)" in result.stdout
    added = set(os.listdir(site)) - before - {"__pycache__"}
    assert added and all("moe_rl" in name for name in added), added  # only moe-rl's editable finder
    assert set(os.listdir(sysconfig.get_paths()["purelib"])) == suite_before  # the environment it sees is untouched
    for tier in ("gpu", "gpu_sglang", "gpu_te"):
        assert f"{tier} not-run" in result.stdout or f"{tier} ready" in result.stdout
    probe = "import moe_rl, torch; print(moe_rl.__file__, torch.__file__)"
    where = subprocess.check_output([venv / "bin" / "python", "-c", probe], text=True).split()
    assert where[0].startswith(str(ROOT)) and where[1].startswith(sysconfig.get_paths()["purelib"])


def test_gpu_tier_imports_neither_sglang_nor_transformer_engine():
    """The `gpu` tier needs CUDA torch and megatron-core only (tests/gpu_tiers.py)."""
    files = sorted((ROOT / "tests" / "gpu").glob("*.py"))
    assert any(f.name.startswith("test_") for f in files)
    for file in files:
        tree = ast.parse(file.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                assert name.split(".")[0] not in ("sglang", "transformer_engine"), f"{file.name}:{node.lineno} {name}"
        if file.name.startswith("test_"):
            assert "pytestmark = pytest.mark.gpu\n" in file.read_text(), f"{file.name}: every test is in the gpu tier"
