"""Imports run downhill: the layering docs/architecture.md section 1 draws, read from the source with `ast`.

Layers, bottom to top: `sync` and `parallel` (libraries that know nothing of the RL system), then
`moe_rl`, whose CLI (`moe_rl/cli.py` and one file per command under `moe_rl/commands/`) is the
top. Every `import x` and `from x import y` of every .py under moe_rl/, parallel/ and sync/ is
checked, inside functions too (a lazy import is still a dependency), relative imports resolved:

1. `sync` and `parallel` never import `moe_rl`;
2. `sync` and `parallel` never import each other. Today neither does (the sync moves any iterable
   of `(name, tensor)`; where it needs parallel's code, e.g. `parallel.peft.write_adapter` for the
   disk adapter route, `moe_rl` passes it in), so both directions are enforced;
3. only `moe_rl/cli.py` and `moe_rl/commands/*` import `moe_rl.commands`: library code never
   depends on a command (what a command and the library share lives in the library);
4. no circle among our modules: not among their import-time imports (those outside function
   bodies, `if TYPE_CHECKING:` blocks included), and not once function-level imports are counted
   too (a lazy import keeps Python from failing on a circle, not a reader from going round it;
   the four circles this test was written against were all closed by lazy imports). A module's
   dependencies can be read, and imported, first. `from a import b` counts as importing the
   module `a.b` when that is a module, else `a`; parent packages a dotted import runs first are
   not counted (a package's `__init__` re-exporting its submodules is not a circle).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("moe_rl", "parallel", "sync")


@dataclass(frozen=True)
class Import:
    file: str  # path relative to the repository root
    line: int
    module: str  # the importing module
    target: str  # the imported module, absolute (a module of ours where one matches)
    at_import_time: bool  # outside any function body

    def where(self) -> str:
        return f"{self.file}:{self.line}"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _function_nodes(tree: ast.AST) -> set[int]:
    """ids of the import nodes that sit inside a function (or lambda) body."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inside.update(id(sub) for sub in ast.walk(node) if isinstance(sub, (ast.Import, ast.ImportFrom)))
    return inside


def read_imports(path: Path, root: Path, modules: set[str]) -> list[Import]:
    """Every import statement of `path`, one `Import` per imported module."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), filename=str(path))
    in_function = _function_nodes(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: `from . import x`, `from ..a import b`
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # `from a import b`: the module a.b when there is one, else a
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
        else:
            continue
        for target in dict.fromkeys(targets):
            found.append(Import(str(path.relative_to(root)), node.lineno, name, target, id(node) not in in_function))
    return found


def all_imports(root: Path = ROOT) -> list[Import]:
    files = sorted(p for package in PACKAGES for p in (root / package).rglob("*.py"))
    modules = {module_name(p, root) for p in files}
    return [imp for path in files for imp in read_imports(path, root, modules)]


def _top(name: str) -> str:
    return name.split(".", 1)[0]


def _is_under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


RULES = (
    (
        "sync and parallel do not import moe_rl",
        lambda i: _top(i.module) in ("sync", "parallel") and _is_under(i.target, "moe_rl"),
    ),
    ("sync does not import parallel", lambda i: _top(i.module) == "sync" and _is_under(i.target, "parallel")),
    ("parallel does not import sync", lambda i: _top(i.module) == "parallel" and _is_under(i.target, "sync")),
    (
        "only moe_rl/cli.py and moe_rl/commands/ import moe_rl.commands",
        lambda i: (
            _is_under(i.target, "moe_rl.commands")
            and not (i.module == "moe_rl.cli" or _is_under(i.module, "moe_rl.commands"))
        ),
    ),
)


def layering_violations(imports: list[Import]) -> list[str]:
    return [f"{imp.where()}: imports {imp.target}: {rule}" for imp in imports for rule, broken in RULES if broken(imp)]


def import_circles(imports: list[Import], lazy: bool) -> list[list[Import]]:
    """The strongly connected components (more than one module, or a module importing itself) of
    the import graph among our modules, each as the edges inside it (Tarjan's algorithm).
    `lazy`: function-level imports are edges too; else only import-time ones."""
    ours = {imp.module for imp in imports}
    edges: dict[str, list[Import]] = {}
    for imp in imports:
        if (lazy or imp.at_import_time) and imp.target in ours:
            edges.setdefault(imp.module, []).append(imp)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:  # recursion depth <= number of modules (~150)
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for edge in edges.get(node, []):
            if edge.target not in index:
                visit(edge.target)
                low[node] = min(low[node], low[edge.target])
            elif edge.target in on_stack:
                low[node] = min(low[node], index[edge.target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            components.append(component)

    for module in sorted(ours):
        if module not in index:
            visit(module)
    circles = []
    for component in components:
        inner = [e for m in sorted(component) for e in edges.get(m, []) if e.target in component]
        if len(component) > 1 or inner:
            circles.append(inner)
    return circles


def test_imports_run_downhill():
    imports = all_imports()
    assert len({imp.module for imp in imports}) > 100  # the scan saw the tree
    violations = layering_violations(imports)
    assert not violations, "upward imports (see tests/test_layering.py):\n" + "\n".join(violations)


def _describe(circles: list[list[Import]]) -> str:
    return "\n".join(
        "circle: "
        + "; ".join(f"{e.where()} {e.module} -> {e.target}{'' if e.at_import_time else ' (lazy)'}" for e in circle)
        for circle in circles
    )


def test_no_import_circles():
    imports = all_imports()
    at_import_time = import_circles(imports, lazy=False)
    assert not at_import_time, "import circles among module-level imports:\n" + _describe(at_import_time)
    with_lazy = import_circles(imports, lazy=True)
    assert not with_lazy, "import circles closed by function-level imports:\n" + _describe(with_lazy)


def test_the_scan_sees_lazy_relative_and_upward_imports(tmp_path):
    """The checks themselves: a function-level upward import, a resolved relative import and a
    two-module circle are all found."""
    for name, text in {
        "sync/__init__.py": "",
        "sync/a.py": "def f():\n    from moe_rl.config import RunConfig\n",
        "sync/b.py": "from . import c\n",
        "sync/c.py": "from sync.b import x\n",
        "moe_rl/__init__.py": "",
        "moe_rl/config.py": "",
        "moe_rl/lib.py": "import moe_rl.commands.train\n",
        "moe_rl/commands/__init__.py": "",
        "moe_rl/commands/train.py": "",
        "parallel/__init__.py": "",
    }.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    imports = all_imports(tmp_path)
    violations, circles = layering_violations(imports), import_circles(imports, lazy=False)
    assert [v.split(": imports ")[0] for v in violations] == ["moe_rl/lib.py:1", "sync/a.py:2"]
    assert "only moe_rl/cli.py and moe_rl/commands/ import moe_rl.commands" in violations[0]
    assert violations[1].endswith("imports moe_rl.config: sync and parallel do not import moe_rl")
    assert [sorted(e.where() for e in circle) for circle in circles] == [["sync/b.py:1", "sync/c.py:1"]]
    (tmp_path / "sync/c.py").write_text("def f():\n    from sync.b import x\n")  # closed lazily
    imports = all_imports(tmp_path)
    assert import_circles(imports, lazy=False) == []
    assert [sorted(e.where() for e in circle) for circle in import_circles(imports, lazy=True)] == [
        ["sync/b.py:1", "sync/c.py:2"]
    ]
