"""Per-level and per-rate figures (``tuner.measure.figures``): their flat keys are spelled as
every earlier study recorded them, and no other module of ``tuner`` builds or parses them.

The source check reads every module under ``tuner/`` with ``ast`` (nothing is imported): outside
``tuner/measure/figures.py`` no module may
  * import or use the names ``LEVEL`` or ``RATE`` (the key separators), nor
  * hold a string (a literal, or a literal part of an f-string) that builds or parses a key:
    ``@c`` or ``@r`` at its end (``f"{name}@c{level}"``, ``.partition("@r")``, ``"@c" in key``)
    or before a digit (``"throughput_ratio@c4"``).
Docstrings and other bare string statements are skipped, and comments are not in the tree, so
both may show keys (``decode_speedup@c4``); so may messages that name the form
(``speedup@c<level>``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tuner.measure.figures import (
    FigureKey,
    Figures,
    level_key,
    parse,
    rate_key,
    rate_text,
    rate_value,
    split_level,
)
from tuner.study.record import TrialRecord, kept

ROOT = Path(__file__).resolve().parents[1]
OWNER = "tuner/measure/figures.py"
SEPARATORS = {"LEVEL", "RATE"}
KEY_TEXT = re.compile(r"@[cr](\d|$)")

# Temporary: files that still build or parse the keys themselves, or carry a shim for those
# that do, until the lead moves them onto tuner.measure.figures. Empty this set, then delete
# the shims it names. An entry is a whole file ("path") or one name a file may still use
# ("path:NAME": importing it, or defining it).
PENDING_LEAD: set[str] = set()     # files allowed to keep the old forms (none left)


def pending(path: str) -> tuple[bool, set[str]]:
    """(whole file allowed, the names it may still use) of ``path`` in PENDING_LEAD."""
    names = {entry.partition(":")[2] for entry in PENDING_LEAD
             if entry.partition(":")[0] == path and ":" in entry}
    return path in PENDING_LEAD, names


def bare_strings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are whole statements (docstrings and the like)."""
    return {id(node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)}


def key_handling(source: str, filename: str, allowed: set[str] = frozenset()) -> list[str]:
    """``line: what`` for every place ``source`` builds or parses a figure key itself, or
    uses a separator name (``allowed``: names it may still use, see PENDING_LEAD)."""
    tree = ast.parse(source, filename)
    skipped = bare_strings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                name = alias.name.rpartition(".")[2]
                if name in SEPARATORS and name not in allowed:
                    found.append(f"{node.lineno}: imports {name}")
        elif isinstance(node, ast.Name) and node.id in SEPARATORS and node.id not in allowed:
            found.append(f"{node.lineno}: uses {node.id}")
        elif isinstance(node, ast.Attribute) and node.attr in SEPARATORS and \
                node.attr not in allowed:
            found.append(f"{node.lineno}: uses .{node.attr}")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                node.name in ("level_key", "rate_key") and node.name not in allowed:
            found.append(f"{node.lineno}: defines {node.name}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                id(node) not in skipped and KEY_TEXT.search(node.value):
            found.append(f"{node.lineno}: {node.value!r}")
    return found


def test_no_module_but_figures_builds_or_parses_level_or_rate_keys():
    found = []
    for path in sorted((ROOT / "tuner").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        whole, names = pending(rel)
        if rel == OWNER or whole:
            continue
        found += [f"{rel}:{hit}" for hit in key_handling(path.read_text(), rel, names)]
    assert not found, ("per-level and per-rate keys are built and read by tuner.measure.figures "
                       "only (level_key, rate_key, parse, Figures):\n" + "\n".join(found))


def test_pending_lead_names_files_that_exist():
    missing = sorted(entry for entry in PENDING_LEAD
                     if not (ROOT / entry.partition(":")[0]).exists())
    assert not missing, f"PENDING_LEAD names files that are gone: {missing}"


@pytest.mark.parametrize("source", [
    'key = f"{name}@c{level}"',
    'base, _, level = objective.partition("@c")',
    'wanted = "@r" in key',
    'value = figures.get("throughput_ratio@c4")',
    'value = figures.get(f"{prefix}goodput@r{rate}")',
    'from tuner.study.record import LEVEL',
    'from tuner.search.objectives import RATE as SUFFIX',
    'key = name + record.LEVEL + str(level)',
    'def rate_key(rate):\n    return "x"',
])
def test_the_source_check_finds_key_handling(source):
    assert key_handling(source, "example.py")


@pytest.mark.parametrize("source", [
    '"""Reads ``decode_speedup@c4``."""',
    'def f():\n    """``goodput@r0.5`` at 0.5 requests/s."""\n    return level_key("x", 4)',
    'x = 1  # "tokens_per_s@c4"',
    'hint = "speedup@c<level>, goodput@r<rate>"',
    'usage = "hub id[@revision]"',
    'key = str(key).replace("@", "_at_")',
])
def test_the_source_check_lets_docs_and_other_at_signs_be(source):
    assert not key_handling(source, "example.py")


def test_the_pending_allowance_is_by_name():
    source = "from tuner.measure.figures import LEVEL\nx = LEVEL"
    assert key_handling(source, "example.py")
    assert not key_handling(source, "example.py", {"LEVEL"})


# -- the module ---------------------------------------------------------------------------------

@pytest.mark.parametrize("rate,text", [(0.5, "0.5"), (4, "4"), (2.0, "2"), ("4.0", "4"),
                                       (0.3333333, "0.333333"), (1000, "1000"), (1.5, "1.5")])
def test_rates_are_spelled_as_every_earlier_study_spelled_them(rate, text):
    assert rate_text(rate) == text == f"{float(rate):g}"
    assert rate_key("goodput", rate) == f"goodput@r{text}"


def test_keys_are_spelled_as_before():
    assert level_key("throughput_ratio", 4) == "throughput_ratio@c4"
    assert level_key("held_out_decode_speedup", 16) == "held_out_decode_speedup@c16"
    assert rate_key("vanilla_tpot_ms_p90", 0.5) == "vanilla_tpot_ms_p90@r0.5"
    assert rate_key("", 4) == "@r4"


@pytest.mark.parametrize("key,parsed", [
    ("throughput_ratio@c4", FigureKey("throughput_ratio", level=4)),
    ("held_out_predicted_decode_speedup@c32", FigureKey("held_out_predicted_decode_speedup",
                                                        level=32)),
    ("goodput@r0.5", FigureKey("goodput", rate="0.5")),
    ("vanilla_goodput@r4", FigureKey("vanilla_goodput", rate="4")),
    ("goodput@r4.0", FigureKey("goodput", rate="4.0")),
    ("quality_pass@1@c2", FigureKey("quality_pass@1", level=2)),
])
def test_parse(key, parsed):
    assert parse(key) == parsed


@pytest.mark.parametrize("key", ["speedup", "throughput_ratio", "quality_pass@1", "speedup@c0",
                                 "speedup@c", "speedup@cx", "speedup@c²", "@c4", "goodput@r",
                                 "goodput@r0", "goodput@r-1", "goodput@rfast", "goodput@r 4",
                                 "hub@revision", "speedup@4"])
def test_parse_refuses_other_keys(key):
    assert parse(key) is None


def test_round_trips():
    for key in ("throughput_ratio@c4", "goodput@r0.5", "tpot_ms_p90@r4", "speedup@c1"):
        assert parse(key).flat() == key and parse(key).canonical
    assert level_key(*_level(parse(level_key("speedup", 8)))) == "speedup@c8"
    assert parse("goodput@r4.0").flat() == "goodput@r4" and not parse("goodput@r4.0").canonical
    assert rate_value("0.5") == 0.5 and rate_value("0") is None and rate_value(" 4") is None


def test_split_level():
    assert split_level("decode_speedup@c4") == ("decode_speedup", 4)
    assert split_level("held_out_throughput_ratio@c16") == ("held_out_throughput_ratio", 16)
    for key in ("speedup", "throughput_ratio", "goodput@r4", "throughput_ratio@r0.5",
                "speedup@cx", "quality_pass@1"):
        assert split_level(key) == (key, None)


def _level(key: FigureKey) -> tuple[str, int]:
    return key.name, key.level


# what an engine study with two levels and two rates recorded (the keys of every earlier study)
OLD_ATTRS = {
    "speedup": 1.2, "throughput_ratio": 1.1, "quality_pass@1": 1.0,
    "throughput_ratio@c1": 1.3, "throughput_ratio@c4": 0.9, "decode_speedup@c1": 1.4,
    "predicted_decode_speedup@c4": 1.05, "held_out_throughput_ratio@c4": 0.95,
    "goodput@r0.5": 0.4, "vanilla_goodput@r0.5": 0.5, "tpot_ratio@r4": 1.2,
    "goodput@r4": 3.0,
}


def test_figures_read_old_flat_keys_back():
    figures = Figures.from_flat(OLD_ATTRS)
    assert figures.at_level("throughput_ratio", 4) == 0.9
    assert figures.at_level("throughput_ratio", 2) is None
    assert figures.at_level("held_out_throughput_ratio", 4) == 0.95
    assert figures.at_rate("goodput", 0.5) == 0.4 == figures.at_rate("goodput", "0.5")
    assert figures.at_rate("goodput", 4.0) == 3.0 == figures.at_rate("goodput", "4")
    assert figures.at_rate("goodput", 1) is None
    assert figures.levels("throughput_ratio") == (1, 4)
    assert figures.levels("decode_speedup") == (1,)
    assert figures.rates("goodput") == ("0.5", "4")
    assert figures.rates("speedup") == ()
    flat = figures.flat()
    assert flat == {k: v for k, v in OLD_ATTRS.items() if "@c" in k or "@r" in k}
    assert Figures.from_flat(flat) == figures


def test_record_keeps_and_reads_the_same_keys():
    record = TrialRecord.from_summary({**OLD_ATTRS, "not_kept": 1.0, "vanilla_perplexity": 2.0})
    assert set(record.figures) == {k for k in OLD_ATTRS if k != "quality_pass@1"} | \
        {"vanilla_perplexity"}
    assert record.at_level("throughput_ratio", 4) == 0.9
    assert kept("tpot_ms_p90@r0.5") and kept("late_send_ms_max@r4") and not kept("pass@1")


def test_the_figures_module_imports_nothing_of_the_tuner():
    """Every layer reads it (config, search, measure, predict, engines, study): it sits below
    them all."""
    tree = ast.parse((ROOT / OWNER).read_text(), OWNER)
    names = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
             for alias in node.names]
    names += [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    assert not [n for n in names if n == "tuner" or n.startswith("tuner.")]
