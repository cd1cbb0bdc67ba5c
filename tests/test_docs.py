"""The docs name only what exists: every repository path and every `module.symbol` that README.md
and docs/*.md name, read from the source with `ast` (nothing is imported).

Checked, outside fenced code blocks:
1. markdown links (`[text](../sync/stages.py)`, relative to the page; web addresses and
   `#anchors` aside): the file or folder exists, inside the repository;
2. inline code that is a path under one of the repository's folders (`moe_rl/rollout/manager.py`,
   `configs/bench/`; patterns with `*`, `{`, `<` aside): it exists;
3. inline code that is a dotted name under `moe_rl`, `parallel` or `sync`
   (`sync.sender.WeightSender.update`): the longest leading part that is a module exists, and
   each following name is defined there (a function, class, assignment or import), a name after
   a class inside that class (a method, class attribute or `self.name` assignment). `sync.<name>`
   where `<name>` is a field of the `sync:` config section (`sync.bucket_bytes`) is that key, not
   a module path. A name that starts with a package of `moe_rl` (`commands.convert.check_output`)
   is checked as `moe_rl.` + it where its first two parts are a module; else it is taken for a
   config key (`rl.mode`, `trainer.tp`).
Paths the docs name as what a run writes (`OUTPUTS`) need not be in a checkout.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FOLDERS = ("moe_rl", "parallel", "sync", "tests", "configs", "scripts", "docs", "benchmarks", ".ci")
PACKAGES = ("moe_rl", "parallel", "sync")

LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"(?<![\w.])[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
SUBPACKAGES = sorted(p.name for p in (ROOT / "moe_rl").iterdir() if (p / "__init__.py").is_file())

OUTPUTS = {
    "benchmarks/gpu_metrics.json": "written by the gpu test tier (tests/gpu/metrics.py) on a GPU machine",
}
"""Paths the docs name as what a run writes, which a checkout need not hold."""


def prose(text: str) -> str:
    """`text` without its fenced code blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


@cache
def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def module_file(parts: list[str]) -> Path | None:
    base = ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def bound_names(body: list[ast.stmt], in_class: bool = False) -> set[str]:
    """Names a module (or class) body binds, and with `in_class` the `self.x` its methods assign."""
    names = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(t.id for t in ast.walk(target) if isinstance(t, ast.Name))
        elif isinstance(node, (ast.If, ast.Try)):  # `if TYPE_CHECKING:` imports, guarded definitions
            names |= bound_names(node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", []))
    if in_class:
        for node in ast.walk(ast.Module(body=body, type_ignores=[])):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id == "self":
                    names.add(node.attr)
    return names


def class_body(body: list[ast.stmt], name: str) -> list[ast.stmt] | None:
    for node in body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node.body
    return None


@cache
def sync_config_keys() -> set[str]:
    """The `sync:` section's fields (`SyncConfig` and the `TransportConfig` it extends), and its
    nested section's as `delta.<field>` (`DeltaConfig`)."""
    keys = set()
    for path, name in ((ROOT / "sync/config.py", "SyncConfig"), (ROOT / "sync/transports/base.py", "TransportConfig")):
        body = class_body(tree(path).body, name)
        keys |= {node.target.id for node in body if isinstance(node, ast.AnnAssign)}
    delta = class_body(tree(ROOT / "sync/config.py").body, "DeltaConfig")
    return keys | {f"delta.{node.target.id}" for node in delta if isinstance(node, ast.AnnAssign)}


def missing_name(dotted: str) -> str | None:
    """Why `dotted` names nothing in the source, or None when it does (or is no module path)."""
    parts = dotted.split(".")
    if parts[0] in SUBPACKAGES:
        if module_file(["moe_rl", *parts[:2]]) is None:
            return None  # a config key (rl.mode), or a package alone
        parts = ["moe_rl", *parts]
    elif parts[0] not in PACKAGES:
        return None
    for cut in range(len(parts), 0, -1):
        path = module_file(parts[:cut])
        if path is not None:
            break
    rest = parts[cut:]
    if not rest:
        return None
    if parts[0] == "sync" and ".".join(parts[1:]) in sync_config_keys():
        return None  # the config key sync.<field> (sync.delta.<field>: a module of that name exists too)
    if parts[0] == "sync" and cut == 1 and rest[0] in sync_config_keys():
        return None  # the config key sync.<field>
    body = tree(path).body
    for i, name in enumerate(rest):
        if name not in bound_names(body, in_class=i > 0):
            where = ".".join(parts[: cut + i])
            return f"{where} ({path.relative_to(ROOT)}) defines no {name!r}"
        body = class_body(body, name)
        if body is None:  # a function, constant or imported name: what follows is not ours to read
            return None
    return None


def named_paths(page: Path, text: str):
    """(what the page wrote, the path it names) for every link and inline path."""
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        yield target, (page.parent / target.split("#")[0]).resolve()
    for code in CODE.findall(text):
        code = code.strip().rstrip(".,;:")
        if code.split("/")[0] in FOLDERS and "/" in code and not re.search(r"[*{}<>\s]", code):
            yield code, ROOT / code.split(":")[0]


def test_every_path_the_docs_name_exists():
    missing = [
        f"{page.relative_to(ROOT)}: {written}"
        for page in PAGES
        for written, path in named_paths(page, prose(page.read_text()))
        if not path.is_relative_to(ROOT) or not (path.exists() or str(path.relative_to(ROOT)) in OUTPUTS)
    ]
    assert not missing, "the docs name paths that do not exist:\n" + "\n".join(missing)


def test_every_module_symbol_the_docs_name_exists():
    missing = []
    for page in PAGES:
        for code in CODE.findall(prose(page.read_text())):
            for dotted in DOTTED.findall(code):
                if (why := missing_name(dotted)) is not None:
                    missing.append(f"{page.relative_to(ROOT)}: `{dotted}`: {why}")
    assert not missing, "the docs name modules or symbols that do not exist:\n" + "\n".join(missing)
