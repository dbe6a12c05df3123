"""Capabilities are declared once and read, never probed.

A capability is a ``ClassVar`` annotated on a base class: ``tuner.engines.base.Engine`` (engines),
``tuner.search.plans.Plan`` (search plans), ``decoding.base.DecodingMethod`` (decoding methods).
Every registered class declares each one in its own class body, even where it keeps the base's
default, so reading one class says all it can do; and no ``getattr(x, "<capability>", ...)`` /
``hasattr(x, "<capability>")`` is left in ``tuner/`` (the attribute always exists: read it).
Sources are read with ``ast``; the classes are imported (no model is loaded).
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import yaml

from decoding.api import discover_methods
from decoding.base import DecodingMethod
from tuner.config.values import get_class
from tuner.engines import ENGINES, engine_named
from tuner.engines.base import Engine
from tuner.search.plans import Plan

ROOT = Path(__file__).resolve().parents[1]


def capabilities(base: type) -> list[str]:
    """The ``ClassVar`` names annotated on ``base`` itself."""
    return [name for name, hint in inspect.get_annotations(base).items()
            if str(hint).startswith("ClassVar")]


def subclasses(base: type) -> list[type]:
    found = []
    for cls in base.__subclasses__():
        found += [cls, *subclasses(cls)]
    return found


def method_targets() -> list[str]:
    """Every ``_target_`` of conf/method/*.yaml."""
    return sorted({yaml.safe_load(p.read_text())["_target_"]
                   for p in (ROOT / "conf" / "method").glob("*.yaml")
                   if p.stem != "auto"})    # method=auto: a union of them


ENGINE_CLASSES = [type(engine_named(kind)) for kind in ENGINES]
PLAN_CLASSES = [cls for cls in subclasses(Plan) if cls.__module__ == "tuner.search.plans"]
METHOD_CLASSES = sorted(set(discover_methods().values()) |
                        {get_class(t) for t in method_targets()}, key=lambda c: c.__name__)
REGISTERED = ([(Engine, cls) for cls in ENGINE_CLASSES] + [(Plan, cls) for cls in PLAN_CLASSES]
              + [(DecodingMethod, cls) for cls in METHOD_CLASSES])


def test_the_registries_are_seen():
    assert {c.__name__ for c in ENGINE_CLASSES} == {"HFEngine", "LlamaCppEngine", "VllmEngine"}
    assert {c.__name__ for c in PLAN_CLASSES} >= {"HeuristicPlan", "GridPlan", "PredictPlan"}
    assert len(METHOD_CLASSES) >= 11 and all(issubclass(c, DecodingMethod)
                                             for c in METHOD_CLASSES)
    assert {"needs_ranking"} <= set(capabilities(Plan))
    assert {"compiles", "draft_tokens_knob", "predicts"} <= set(capabilities(Engine))
    assert {"replayable", "traceable", "keeps_history"} <= set(capabilities(DecodingMethod))


@pytest.mark.parametrize("base,cls", REGISTERED, ids=[c.__name__ for _, c in REGISTERED])
def test_each_class_declares_every_capability_itself(base, cls):
    missing = [name for name in capabilities(base) if name not in vars(cls)]
    assert not missing, (f"{cls.__module__}.{cls.__name__} inherits {missing} from "
                         f"{base.__name__}: declare each in its own class body")
    flags = [name for name, hint in inspect.get_annotations(base).items()
             if hint == "ClassVar[bool]"]
    for name in flags:     # a flag, or a property where the constructor decides (Ouroboros)
        assert isinstance(vars(cls)[name], (bool, property)), (cls.__name__, name)


def capability_probes(path: Path, names: set[str], root: Path = ROOT) -> list[str]:
    """``getattr(x, "<capability>"...)`` / ``hasattr(x, "<capability>")`` calls in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "hasattr") and len(node.args) >= 2 and \
                isinstance(node.args[1], ast.Constant) and node.args[1].value in names:
            found.append(f"{path.relative_to(root)}:{node.lineno}: {node.func.id}(..., "
                         f"{node.args[1].value!r})")
    return found


def test_no_capability_is_probed_in_the_tuner():
    names = set(capabilities(Engine)) | set(capabilities(Plan)) | \
        set(capabilities(DecodingMethod)) | {"drafter"}
    found = [hit for path in sorted((ROOT / "tuner").rglob("*.py"))
             for hit in capability_probes(path, names)]
    assert not found, "read the declared capability instead:\n" + "\n".join(found)


def test_the_probe_check_sees_a_probe(tmp_path):
    """The check above can fail: probes written the old way are found, a config read is not."""
    probe = tmp_path / "probe.py"
    probe.write_text('def f(method, plan, cfg):\n'
                     '    return getattr(method, "replayable", False), \\\n'
                     '        hasattr(plan, "needs_ranking"), getattr(cfg, "head_dim", None)\n')
    assert capability_probes(probe, {"replayable", "needs_ranking"}, tmp_path) == [
        "probe.py:2: getattr(..., 'replayable')", "probe.py:3: hasattr(..., 'needs_ranking')"]
