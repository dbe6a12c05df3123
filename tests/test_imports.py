"""The layers of the code, checked on its import graph.

The graph of ``tuner``, ``decoding``, ``eagle_training`` and ``bench`` is read with ``ast`` from
the source (nothing is imported to check it): imports at module level and inside functions alike,
except those under ``if TYPE_CHECKING:`` (never run). An edge goes to the module imported (``from
a.b import c`` names the module ``a.b.c`` when there is one, else ``a.b``) and to the packages
above it that the importer is not already inside (importing ``a.b.c`` runs ``a/b/__init__.py``).

  * no import cycle among the modules of any one package (a cycle is printed, edge by edge, with
    file:line);
  * ``FORBIDDEN``: (importer prefix, imported prefix, why) pairs; the study never imports the
    Slurm launcher above it, the decoding library never imports the tuner or its frameworks,
    measuring and the config sit below the engines, benchmarks use public entry points;
  * nothing in ``tuner`` outside ``tuner/engines/`` names an engine (a string literal equal to an
    ``engine.kind`` of ``conf/engine/``): the tuner asks the engine object;
  * ``eagle_training`` uses the tuner only through its public entry points
    (``PUBLIC_FOR_TRAINING``).

``tests/test_models.py::test_decoding_imports_no_tuner_optuna_mlflow_or_hydra`` checks the same
rule for ``decoding`` at run time (what importing it pulls in, third-party modules included).
"""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tuner", "decoding", "eagle_training", "bench")

FORBIDDEN: list[tuple[str, str, str]] = [
    ("tuner.study", "tuner.cluster", "the Slurm launcher sits above the study: worker liveness "
     "is tuner.study.liveness, the job check is handed down by tuner.run"),
    ("decoding", "tuner", "decoding is the library; the tuner is built on it, never the reverse"),
    ("decoding", "optuna", "decoding depends on torch and transformers only"),
    ("decoding", "mlflow", "decoding depends on torch and transformers only"),
    ("decoding", "hydra", "decoding depends on torch and transformers only"),
    ("decoding", "omegaconf", "decoding depends on torch and transformers only"),
    ("tuner.measure", "tuner.study", "measuring is below the study: the study uses measurements, "
     "a measurement knows no study"),
    ("tuner.config", "tuner.engines", "the config is checked before anything loads: it names "
     "engines, it does not import them"),
    ("bench", "tuner.study", "benchmarks measure decoding and engines, not a study's internals"),
    ("tuner.measure", "tuner.engines", "the paired protocol and the records are below the "
     "engines: an engine's backend uses them"),
    # the rooms of prediction, the study, tracking and the engines, one way between them:
    # engines -> predict (forms, surfaces); study -> engines, predict; answer -> study;
    # tracking -> answer, study
    ("tuner.predict", "tuner.study", "prediction prices and plans; the study and the answer hand "
     "it its points (tuner.answer.predicted), never the reverse"),
    ("tuner.predict", "tuner.engines", "prediction owns the schedules' content and forms; each "
     "engine writes its own form from it (Engine.schedule_form)"),
    ("tuner.predict", "tuner.tracking", "prediction records nothing itself"),
    ("tuner.study", "tuner.tracking", "the study runs trials and tracking renders them: "
     "tuner.run hands the listeners down"),
    ("tuner.answer", "tuner.tracking", "the answer decides (StudyOutcome) and tracking renders: "
     "tuner.run hands tuner.tracking.render.publish down to the finish"),
    ("tuner.study", "tuner.answer", "the study runs the trials; the answer reads them once they "
     "are in (tuner.run calls the finish after the optimize loop), never the reverse"),
    ("tuner.predict", "tuner.answer", "prediction prices; the answer reads its calibration"),
    ("tuner.engines", "tuner.answer", "an engine measures; the answer decides from the trials"),
    ("tuner.measure", "tuner.answer", "a measurement knows no study and no answer"),
    ("tuner.answer", "tuner.watch", "the watch reads a study's outcome, never the reverse"),
    ("bench", "tuner.answer", "benchmarks measure decoding and engines, not a study's answer"),
    ("tuner.search", "tuner.answer", "the search plans and claims points; the answer reads the "
     "trials once they are in"),
    ("tuner.search", "tuner.tracking", "the search reports through the study's listeners"),
    ("tuner.search", "tuner.watch", "the watch reads a study's outcome, never the reverse"),
    ("tuner.engines", "tuner.study", "an engine measures; the study decides what to measure"),
    ("tuner.engines", "tuner.tracking", "an engine reports through the study's listeners"),
    ("tuner.engines", "tuner.watch", "the watch reads an engine's metrics, never the reverse"),
    ("tuner.study", "tuner.watch", "the watch reads a study's outcome, never the reverse"),
    ("tuner.predict", "tuner.watch", "the watch prices with prediction, never the reverse"),
]
# what eagle_training may import from the tuner: the task data API
PUBLIC_FOR_TRAINING = ("tuner.tasks",)


def under(module: str, prefix: str) -> bool:
    """``module`` is ``prefix`` or inside it (``tuner.measure`` is not under ``tuner.meas``)."""
    return module == prefix or module.startswith(prefix + ".")


def module_files() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(module: str, path: Path, known: set[str], typing: bool = False
               ) -> list[tuple[str, int]]:
    """(imported module, line) of every import ``module`` runs, at any depth; ``if
    TYPE_CHECKING:`` blocks are skipped (their ``else`` is kept) unless ``typing``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child.test) and not typing:
                for other in child.orelse:
                    visit_one(other)
                continue
            visit_one(child)

    def visit_one(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                found.append((sub if sub in known else source, node.lineno))
        visit(node)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return found


@lru_cache(maxsize=2)
def import_graph(typing: bool = False) -> dict[str, dict[str, int]]:
    """{importer: {imported: first line}}; imported names are our modules (the longest known
    prefix, plus the packages above it that the importer is not inside) or third-party modules
    as written; ``typing``: with the imports under ``if TYPE_CHECKING:`` too."""
    files = module_files()
    known = set(files)
    graph: dict[str, dict[str, int]] = {}
    for module, path in files.items():
        edges: dict[str, int] = {}
        for target, line in imports_of(module, path, known, typing):
            inside = target
            while inside and inside not in known:
                inside = inside.rpartition(".")[0]
            if not inside:                                   # third party or stdlib
                edges.setdefault(target, line)
                continue
            parts = inside.split(".")
            for depth in range(1, len(parts) + 1):         # a.b.c runs a, a.b, a.b.c
                step = ".".join(parts[:depth])
                if step in known and step != module and not under(module, step):
                    edges.setdefault(step, line)
        graph[module] = edges
    return graph


def where(importer: str, imported: str) -> str:
    path = module_files()[importer].relative_to(ROOT)
    return f"{path}:{import_graph()[importer][imported]}"


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as [a, b, ..., a], or None (depth-first, iterative)."""
    state: dict[str, int] = {}                     # 1: on the current path, 2: done
    for start in sorted(graph):
        if start in state:
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def edges_where(importer_ok, imported_ok) -> list[str]:
    """The matching edges as ``file:line: a imports b``; a package passed through on the way to
    a module the same importer imports (``tuner.cluster`` for ``tuner.cluster.slurm``) is left
    out."""
    found = []
    for a, edges in sorted(import_graph().items()):
        if not importer_ok(a):
            continue
        hits = [b for b in sorted(edges) if imported_ok(b)]
        found += [f"{where(a, b)}: {a} imports {b}" for b in hits
                  if not any(c != b and under(c, b) for c in hits)]
    return found


def violations(importer_prefix: str, imported_prefix: str) -> list[str]:
    return edges_where(lambda a: under(a, importer_prefix), lambda b: under(b, imported_prefix))


def test_the_graph_sees_the_code():
    graph = import_graph()
    assert {"tuner.run", "tuner.study.liveness", "decoding.models", "eagle_training.train"} <= \
        set(graph)
    assert "tuner.study.liveness" in graph["tuner.study.trials"]         # module level
    assert "tuner.study.trials" in graph["tuner.run"]                    # inside a function
    assert "tuner.study.settings" not in graph["tuner.study.trials"]     # TYPE_CHECKING only
    assert "tuner.study" in graph["tuner.run"]                           # a package run on the way
    assert "optuna" in graph["tuner.study.liveness"]                     # third party as written


def test_no_circle_anywhere_type_checking_included():
    """Across every package at once, and counting the imports only a type checker runs: no
    module reaches itself (a circle through annotations still ties the modules' designs: the
    search's cost, points and ranking once formed one, as did the records, the A/A control and
    the evaluator's protocol)."""
    graph = {a: {b for b in edges if b in import_graph(True)}
             for a, edges in import_graph(True).items()}
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle_among_a_packages_modules(package):
    """(eagle_training: ``train`` and ``eagle3`` share ``features``, neither imports back.)"""
    inside = {a: {b for b in edges if under(b, package)}
              for a, edges in import_graph().items() if under(a, package)}
    cycle = find_cycle(inside)
    if cycle:
        shown = "\n".join(f"  {a} -> {b}   ({where(a, b)})" for a, b in zip(cycle, cycle[1:]))
        print(f"import cycle:\n{shown}")
        pytest.fail(f"import cycle among {package} modules (cut one edge):\n{shown}")


@pytest.mark.parametrize("importer,imported,why", FORBIDDEN,
                         ids=[f"{a}-/->{b}" for a, b, _ in FORBIDDEN])
def test_forbidden_imports(importer, imported, why):
    found = violations(importer, imported)
    assert not found, f"{importer} must not import {imported} ({why}):\n" + "\n".join(found)


def test_eagle_training_uses_only_public_tuner_entry_points():
    bad = edges_where(lambda a: under(a, "eagle_training"),
                      lambda b: under(b, "tuner") and
                      not any(under(b, ok) or under(ok, b) for ok in PUBLIC_FOR_TRAINING))
    assert not bad, (f"eagle_training may import from the tuner only {PUBLIC_FOR_TRAINING} "
                     "(its internals are not an API):\n" + "\n".join(bad))


def engine_kinds() -> set[str]:
    import yaml
    return {yaml.safe_load(path.read_text())["kind"]
            for path in (ROOT / "conf" / "engine").glob("*.yaml")}


def test_no_module_outside_tuner_engines_names_an_engine():
    kinds = engine_kinds()
    assert {"hf", "llamacpp", "vllm"} <= kinds          # the scan below looks for these
    named = []
    for path in sorted((ROOT / "tuner").rglob("*.py")):
        if (ROOT / "tuner" / "engines") in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and node.value in kinds:
                named.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert not named, ("engines are named only in tuner/engines/ and conf/engine/ (ask the "
                       "engine object: tuner.engines.engine_named):\n" + "\n".join(named))
