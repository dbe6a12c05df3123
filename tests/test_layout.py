"""Tests follow the code, never each other: no module under tests/ imports a ``tests/test_*.py``
module (what several need lives in ``tests/helpers/``), and no module of the code or its tools
(bench/, tuner/, decoding/, eagle_training/, scripts/) imports anything from ``tests``.

Imports are read with ``ast`` from the source, those inside functions included (nothing is
imported to check it).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
CODE_DIRS = ("bench", "tuner", "decoding", "eagle_training", "scripts")


def imported_modules(path: Path) -> list[tuple[int, list[str]]]:
    """(line, dotted modules) of every import statement in ``path``, at any depth: ``import a, b``
    gives ``a`` and ``b``; ``from x import y`` gives ``x`` and ``x.y`` (y may be a submodule);
    relative imports are resolved against the file's package."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = path.relative_to(ROOT).parent.parts
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.append((node.lineno, [alias.name for alias in node.names]))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[: len(package) - (node.level - 1)])
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((node.lineno,
                          [module] + [f"{module}.{alias.name}" for alias in node.names]))
    return found


def python_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


def suite_modules() -> set[str]:
    return {p.stem for p in TESTS.glob("test_*.py")}


def names_a_test_module(module: str, tests: set[str]) -> bool:
    """``tests.test_x`` (or below it), or a bare ``test_x`` that is one of tests/test_*.py."""
    parts = module.split(".")
    if parts[0] == "tests" and len(parts) > 1:
        return parts[1].startswith("test_")
    return parts[0] in tests


def test_no_test_module_imports_another():
    tests = suite_modules()
    assert "test_layout" in tests and "test_methods" in tests     # the glob sees the suite
    bad = [f"{path.relative_to(ROOT)}:{line}: imports {hits[0]}"
           for path in python_files(TESTS)
           for line, modules in imported_modules(path)
           if (hits := [m for m in modules if names_a_test_module(m, tests)])]
    assert not bad, ("a test module imports another; move what they share to tests/helpers/:\n"
                     + "\n".join(bad))


def test_the_code_imports_no_tests():
    files = [p for d in CODE_DIRS for p in python_files(ROOT / d)]
    assert any(p.parent.name == "bench" for p in files)          # the walk sees the code
    bad = [f"{path.relative_to(ROOT)}:{line}: imports {hits[0]}"
           for path in files
           for line, modules in imported_modules(path)
           if (hits := [m for m in modules if m == "tests" or m.startswith("tests.")])]
    assert not bad, ("code imports test modules; tests may import the code, never the reverse:\n"
                     + "\n".join(bad))
