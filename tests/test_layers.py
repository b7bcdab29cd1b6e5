"""The layering docs/architecture.md draws, read off the source.

Inside the package every import goes down the layers (``LAYERS``): layout math, then the
transfer layer's wire, device, and the prefill and decode roles (neither imports the other),
the backends, the vLLM adapter, the connector, the toolkit and the demo. No module takes part
in an import circle. The package imports neither the lab (``lab/``) nor the tests; the lab
imports no tests and edits no ``sys.path``; no package function is over 80 lines."""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvshare_connector"
LAB = ROOT / "lab"
MAX_FUNCTION_LINES = 80
P = "kvshare_connector"
#: The package's layers, lowest first; a module may import its own layer's and lower ones.
LAYERS = [
    (f"{P}.common",),
    (f"{P}.layout",),
    (f"{P}.transfer.wire",),
    (f"{P}.transfer.device",),
    (f"{P}.transfer.prefill", f"{P}.transfer.decode"),  # siblings: neither imports the other
    (f"{P}.backends",),
    (f"{P}.vllm",),
    (f"{P}.connector", f"{P}.plugin"),
    (f"{P}.toolkit",),
    (f"{P}.demo",),
]
#: What the pure layout math may import beyond the standard library and itself.
LAYOUT_MAY_IMPORT = ("numpy", f"{P}.layout", f"{P}.common")


def _modules(folder: Path) -> Iterator[tuple[str, Path, ast.Module]]:
    for path in sorted(folder.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        yield name, path, ast.parse(path.read_text(), filename=str(path))


def _imported(tree: ast.Module, name: str, path: Path) -> set[str]:
    """Every module a file imports (``from a import b``: ``a`` and ``a.b``), relative
    imports resolved against its package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    typing_only = {  # ``if TYPE_CHECKING:`` imports never run
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for stmt in node.body
        for inner in ast.walk(stmt)
    }
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            out.add(base)
            out |= {f"{base}.{alias.name}" for alias in node.names}
    return out


def _under(name: str, top: str) -> bool:
    return name == top or name.startswith(top + ".")


def _layer(name: str) -> tuple[int, str] | None:
    for rank, tops in enumerate(LAYERS):
        for top in tops:
            if _under(name, top):
                return rank, top
    return None


PACKAGE_MODULES = {name: (path, tree) for name, path, tree in _modules(PACKAGE)}


def _package_imports(name: str) -> set[str]:
    """The package modules ``name`` imports (``from a import b``: ``a.b`` if a module)."""
    path, tree = PACKAGE_MODULES[name]
    out = set()
    for m in _imported(tree, name, path):
        while m and m not in PACKAGE_MODULES:
            m = m.rpartition(".")[0]
        inside = PACKAGE_MODULES.get(m, (Path(),))[0].name == "__init__.py" and _under(name, m)
        if m and m != name and _under(m, P) and not inside:  # not its own package's __init__
            out.add(m)
    return out


def test_every_package_module_has_a_layer():
    bare = (P, f"{P}.transfer")  # docstrings only
    assert [n for n in PACKAGE_MODULES if n not in bare and _layer(n) is None] == []


def test_imports_go_down_the_layers():
    bad = []
    for name in PACKAGE_MODULES:
        own = _layer(name)
        if own is None:
            continue
        for m in _package_imports(name):
            theirs = _layer(m)
            if theirs is None:  # the package's own __init__
                continue
            if theirs[0] > own[0] or (theirs[0] == own[0] and theirs[1] != own[1]):
                bad.append(f"{name} imports {m}")
    assert bad == []


def test_the_layout_math_imports_numpy_only():
    bad = [
        f"{name} imports {m}"
        for name, (path, tree) in PACKAGE_MODULES.items()
        if _under(name, f"{P}.layout")
        for m in _imported(tree, name, path)
        if m.split(".")[0] not in sys.stdlib_module_names and m != "__future__"
        if not any(_under(m, top) for top in LAYOUT_MAY_IMPORT)
    ]
    assert bad == []


def test_the_transfer_layer_does_not_import_vllm():
    bad = [
        f"{name} imports {m}"
        for name, (path, tree) in PACKAGE_MODULES.items()
        if _under(name, f"{P}.transfer")
        for m in _imported(tree, name, path)
        if _under(m, "vllm")
    ]
    assert bad == []


def test_no_import_circle():
    graph = {name: _package_imports(name) for name in PACKAGE_MODULES}
    state: dict[str, int] = {}  # 1: on the path, 2: done
    circles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert circles == []


def test_the_package_imports_no_lab_or_test_code():
    bad = [
        f"{name}: {m}"
        for name, (path, tree) in PACKAGE_MODULES.items()
        for m in _imported(tree, name, path)
        if any(_under(m, top) for top in ("tests", "lab"))
    ]
    assert bad == []


@pytest.mark.parametrize("folder", ["benchmarks", "gpu_checks", "tools"])
def test_the_lab_imports_no_tests_and_leaves_sys_path_alone(folder):
    bad = []
    for name, path, tree in _modules(LAB / folder):
        bad += [f"{name}: imports {m}" for m in _imported(tree, name, path) if _under(m, "tests")]
        if "sys.path" in ast.unparse(tree):
            bad.append(f"{name}: edits sys.path")
    assert bad == []


def test_no_package_function_is_over_80_lines():
    long = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines})"
        for path, tree in PACKAGE_MODULES.values()
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        if (lines := (node.end_lineno or node.lineno) - node.lineno + 1) > MAX_FUNCTION_LINES
    ]
    assert long == []
