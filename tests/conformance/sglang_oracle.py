"""SGLang 0.5.23's own Python modules, importable on a CPU machine: the conformance tier's oracle.

SGLang cannot be installed here (it pins a CUDA torch and GPU kernels), but the modules that define
its HTTP contract and its weight-sync behaviour are plain Python. This module:

1. `ensure()`: downloads the wheel once (`pip download --no-deps sglang==0.5.23`), unzips it into a
   cache (`.cache/sglang-0.5.23-{SOABI}/` in the repository, or under `$MOE_RL_SGLANG_CACHE`), and
   installs the few small packages SGLang's modules import at module level with
   `pip install --no-deps --target` beside it. Some are compiled (msgspec, orjson, pydantic-core),
   so the site is one per interpreter: keyed by its ABI tag (`cpython-311-x86_64-linux-gnu`), and
   rebuilt when the tag it records differs. Nothing goes into the project's `.venv`.
2. `install()`: makes `import sglang.srt...` work in *this* process without running
   `sglang/__init__.py`: a package object whose `__path__` points into the unzipped wheel, a lazy
   `sglang.srt.configs` (its `__init__` imports every multimodal config), and stand-ins for the GPU
   or notebook packages SGLang imports but never calls on these paths (`triton`, `torchvision`,
   `IPython`). Torch and transformers modules that probe for triton / torchvision are imported
   first, so they keep seeing them absent.

`install()` changes `sys.modules` for good: call it only in processes made for it (the SGLang
twin's processes, `call()`), never in the pytest process.
"""

from __future__ import annotations

import ast
import importlib
import importlib.abc
import importlib.machinery
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import sysconfig
import types
import zipfile
from pathlib import Path

SGLANG_VERSION = "0.5.23"
# What SGLang's request classes, server args, weight updaters and bucket code import at module
# level, at the versions SGLang 0.5.23 pins where it pins one.
DEPENDENCIES = [
    "msgspec==0.23.0",
    "orjson==3.13.0",
    "pybase64==1.5.1",
    "pyzmq==27.3.0",
    "starlette==1.10.0",
    "apache-tvm-ffi==0.1.11",
    "dill==0.4.1",
    "sentencepiece==0.2.1",
    "compressed-tensors==0.18.0",
    "loguru==0.7.3",
    "gguf==0.19.0",
    "openai==2.8.0",
    "sniffio==1.3.1",
    "partial-json-parser==0.2.1.1.post7",
    "httpx==0.28.1",
    "httpcore==1.0.9",
    "distro==1.9.0",
    "jiter==0.12.0",
    "setproctitle==1.3.8",
    "einops==0.8.2",
]
STUBBED = ("triton", "torchvision", "IPython")
_stubbed = set(STUBBED)
_REPO = Path(__file__).resolve().parents[2]


def abi_tag() -> str:
    """This interpreter's extension-module ABI (compiled packages built for it load only here)."""
    return sysconfig.get_config_var("SOABI") or f"{sys.implementation.cache_tag}-{sys.platform}"


def cache_dir() -> Path:
    base = Path(os.environ.get("MOE_RL_SGLANG_CACHE", _REPO / ".cache"))
    return base / f"sglang-{SGLANG_VERSION}-{abi_tag()}"


def ensure() -> Path:
    """Download and unpack SGLang's wheel and its import-time dependencies for this interpreter
    (once); returns the cache."""
    root = cache_dir()
    done, wanted = root / ".complete", "\n".join([SGLANG_VERSION, abi_tag(), *DEPENDENCIES])
    if done.exists() and done.read_text() == wanted:
        return root
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    wheels = root / "wheels"
    subprocess.run(pip + ["download", "--no-deps", f"sglang=={SGLANG_VERSION}", "-d", str(wheels)], check=True)
    (wheel,) = wheels.glob(f"sglang-{SGLANG_VERSION}-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(root / "wheel")
    subprocess.run(pip + ["install", "--no-deps", "--target", str(root / "deps"), *DEPENDENCIES], check=True)
    done.write_text(wanted)
    return root


class _Stub:
    """Any attribute, any call; a decorator returns what it decorates (`@triton.jit`)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return self

    def __mro_entries__(self, bases):
        return (object,)


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub()


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in _stubbed:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__version__ = "3.0.0"  # SGLang compares triton's version at import (mamba kernels)
        return module

    def exec_module(self, module):
        pass


def _lazy_package(root: Path, name: str) -> None:
    """`name` as a package whose `__init__` is not run: its re-exported names import on first use."""
    path = root / "wheel" / name.replace(".", "/")
    where = {}
    for node in ast.walk(ast.parse((path / "__init__.py").read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(name + "."):
            for alias in node.names:
                where[alias.asname or alias.name] = node.module
    module = types.ModuleType(name)
    module.__path__ = [str(path)]

    def __getattr__(attr):
        if attr in where:
            return getattr(importlib.import_module(where[attr]), attr)
        raise AttributeError(attr)

    module.__getattr__ = __getattr__
    sys.modules[name] = module


def install(models: bool = False) -> None:
    """Make SGLang's modules importable in this process (see the module docstring). `models`: also
    SGLang's model classes, built on its CPU backend (`SGLANG_USE_CPU_ENGINE=1`), with stand-ins for
    the kernel packages they import at module level (`sgl_kernel`, `vllm`) and never call while
    a model is built and loads weights."""
    if models:
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
        _stubbed.update(("sgl_kernel", "vllm"))
    if "sglang" in sys.modules:
        return
    root = ensure()
    # Probe triton / torchvision now, while they are absent; these results are cached.
    import torch._inductor.codegen.triton  # noqa: F401
    import torch._inductor.ir  # noqa: F401
    import torch._inductor.select_algorithm  # noqa: F401
    import torch.utils._triton
    import torch.utils.flop_counter  # noqa: F401
    import transformers.image_utils  # noqa: F401
    import transformers.processing_utils  # noqa: F401
    import transformers.utils.import_utils

    torch.utils._triton.has_triton_package()
    transformers.utils.import_utils.is_torchvision_available()
    sys.path.append(str(root / "deps"))
    sys.meta_path.insert(0, _StubFinder())
    package = types.ModuleType("sglang")
    package.__path__ = [str(root / "wheel" / "sglang")]
    sys.modules["sglang"] = package
    _lazy_package(root, "sglang.srt.configs")


def extract(module: str, qualname: str, namespace: dict):
    """SGLang's own function `qualname` ("Class.method" or "function") from `module`'s source, compiled
    in `namespace` (the names it uses), for modules that cannot be imported on CPU (GPU kernels or
    packages the oracle does not install): the code run is SGLang's, only its globals are given."""
    path = cache_dir() / "wheel" / (module.replace(".", "/") + ".py")
    tree, node = ast.parse(path.read_text()), None
    for part in qualname.split("."):
        body = tree.body if node is None else node.body
        node = next(
            n for n in body if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == part
        )
    node.decorator_list = []
    code = compile(
        ast.Module(body=[node], type_ignores=[]),
        f"{path}:{qualname}",
        "exec",
        flags=__import__("__future__").annotations.compiler_flag,
        dont_inherit=True,
    )
    exec(code, namespace)
    return namespace[node.name]


def _run(fn, args, kwargs, conn):
    try:
        install()
        conn.send((True, fn(*args, **kwargs)))
    except BaseException as error:  # noqa: BLE001 - sent back to the caller and raised there
        import traceback

        conn.send((False, f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))


def call(fn, *args, **kwargs):
    """Run `fn(*args, **kwargs)` in a fresh process with SGLang importable; returns its (picklable)
    result or raises AssertionError with the child's traceback."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_run, args=(fn, args, kwargs, child), daemon=True)
    process.start()
    child.close()
    try:
        ok, value = parent.recv()
    except EOFError:
        raise AssertionError(f"the oracle process died (exit code {process.join(5) or process.exitcode})") from None
    process.join(30)
    if not ok:
        raise AssertionError(value)
    return value


if __name__ == "__main__":
    print(ensure())
