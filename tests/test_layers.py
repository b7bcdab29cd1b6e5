"""The layering the docs promise (docs/architecture.md), read off the source: inside the
package only ``toolkit/`` and ``devtools/`` import ``devtools/``; the drivers outside it
(``benchmarks/``, ``gpu_checks/``) import no test code and edit no ``sys.path``, and
``gpu_checks/`` does not import ``benchmarks/``; no package function is over 80 lines."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvshare_connector"
DRIVERS = ("benchmarks", "gpu_checks")
MAX_FUNCTION_LINES = 80


def _modules(folder: Path) -> Iterator[tuple[Path, ast.Module]]:
    for path in sorted(folder.rglob("*.py")):
        yield path, ast.parse(path.read_text(), filename=str(path))


def _imported(tree: ast.Module, path: Path) -> set[str]:
    """Every module a file imports, relative imports resolved against its package."""
    package = path.relative_to(ROOT).parent.parts
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package[: len(package) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            out.add(base)
            out |= {f"{base}.{alias.name}" for alias in node.names}
    return out


def _under(name: str, top: str) -> bool:
    return name == top or name.startswith(top + ".")


def test_only_toolkit_and_devtools_import_devtools():
    allowed = (PACKAGE / "devtools", PACKAGE / "toolkit")
    bad = [
        str(path.relative_to(ROOT))
        for path, tree in _modules(PACKAGE)
        if not path.is_relative_to(allowed[0]) and not path.is_relative_to(allowed[1])
        if any(_under(m, "kvshare_connector.devtools") for m in _imported(tree, path))
    ]
    assert bad == []


def test_the_package_imports_no_driver_or_test_code():
    bad = [
        f"{path.relative_to(ROOT)}: {name}"
        for path, tree in _modules(PACKAGE)
        for name in _imported(tree, path)
        if any(_under(name, top) for top in ("tests", *DRIVERS))
    ]
    assert bad == []


@pytest.mark.parametrize("folder", DRIVERS)
def test_drivers_import_no_tests_and_leave_sys_path_alone(folder):
    below = ("tests", "benchmarks") if folder == "gpu_checks" else ("tests",)
    bad = []
    for path, tree in _modules(ROOT / folder):
        names = _imported(tree, path)
        bad += [
            f"{path.relative_to(ROOT)}: imports {m}"
            for m in names
            if any(_under(m, top) for top in below)
        ]
        if "sys.path" in ast.unparse(tree):
            bad.append(f"{path.relative_to(ROOT)}: edits sys.path")
    assert bad == []


def test_no_package_function_is_over_80_lines():
    long = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines})"
        for path, tree in _modules(PACKAGE)
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        if (lines := (node.end_lineno or node.lineno) - node.lineno + 1) > MAX_FUNCTION_LINES
    ]
    assert long == []
