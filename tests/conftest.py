"""Fixtures for every test tier. The tiny models themselves are in `tests/tiny_models.py` (plain
helpers, imported as `tests.tiny_models`, so rank functions under `parallel.world.spawn` and
other conftests use them too)."""

from __future__ import annotations

import multiprocessing.process
import subprocess

import pytest

from tests.gpu_tiers import TIERS, missing


def pytest_collection_modifyitems(config, items):
    """A test marked with a GPU tier (`tests/gpu_tiers.py`) is skipped, naming what is missing,
    where the tier cannot run: on a CPU machine every GPU tier skips at once."""
    reasons = {tier: missing(tier) for tier in TIERS}
    for item in items:
        for tier, lacking in reasons.items():
            if lacking and item.get_closest_marker(tier) is not None:
                item.add_marker(pytest.mark.skip(reason=f"tier {tier} needs {', '.join(lacking)}"))


@pytest.fixture(scope="session")
def cpu_patches():
    """`parallel/cpu_compat`'s patches in pytest's own process (a no-op when CUDA is available).

    They cannot be undone, so they are applied when a test that runs Megatron in this process
    first asks for them, never at the import of a test module (collection would patch torch for
    every test of the session). A rank function under `parallel.world.spawn` runs in a fresh
    process: it calls `cpu_compat.apply()` itself (`parallel.model` does so for a model build)."""
    from parallel import cpu_compat

    cpu_compat.apply()


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """A random tiny Qwen3-MoE checkpoint (the engine tests' 3-layer one, seed 0, float32)."""
    from tests.engine.engine_helpers import save_tiny_model

    return save_tiny_model("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test marked neither `world` nor with a GPU tier may not start a process (a gloo world, an
    engine, Ray, a subprocess), in its fixtures either: it belongs to `make test-fast`, which must
    stay fast. Starting one fails the test, naming the marker to add."""
    if any(item.get_closest_marker(name) for name in ("world", *TIERS)):
        yield
        return

    def refuse(*args, **kwargs):
        raise RuntimeError(f"{item.nodeid} starts a process: mark it (or its module) pytest.mark.world")

    saved = multiprocessing.process.BaseProcess.start, subprocess.Popen.__init__
    multiprocessing.process.BaseProcess.start, subprocess.Popen.__init__ = refuse, refuse
    try:
        yield
    finally:
        multiprocessing.process.BaseProcess.start, subprocess.Popen.__init__ = saved
