"""Per-level and per-rate figures: the one place that knows how they are spelled as flat keys.

An engine server measures figures per concurrency level (``tuner.measure.levels``:
``throughput_ratio`` at 4 requests in flight) and per request rate (``tuner.measure.rates``:
``goodput`` at 2 requests/s). Optuna's user attributes, MLflow and the summaries hold them under
flat keys, ``<name>@c<level>`` and ``<name>@r<rate>``::

    level_key("throughput_ratio", 4)  -> "throughput_ratio@c4"
    rate_key("goodput", 2.0)          -> "goodput@r2"        (the rate as ``f"{rate:g}"``: 0.5, 4)
    parse("goodput@r0.5")             -> FigureKey("goodput", rate="0.5")

Everything else builds and reads those keys through this module (``tests/test_figures.py``
checks it on the source), so the spelling every earlier study recorded is the one read back:
``Figures.from_flat(trial.user_attrs).at_level("decode_speedup", 4)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

LEVEL = "@c"        # <name>@c<level>: a figure at one concurrency level
RATE = "@r"         # <name>@r<rate>: a figure at one request rate


def rate_text(rate: float | str) -> str:
    """A rate as the keys spell it: ``4`` for 4 (or 4.0, or "4.0") requests/s, ``0.5`` for 0.5;
    rates equal within 6 significant digits share it."""
    return f"{float(rate):g}"


def level_key(name: str, level: int) -> str:
    """``name`` at concurrency ``level``: ``throughput_ratio@c4``."""
    return f"{name}{LEVEL}{int(level)}"


def rate_key(name: str, rate: float | str) -> str:
    """``name`` at request rate ``rate`` (requests/s): ``goodput@r4``, ``goodput@r0.5``."""
    return f"{name}{RATE}{rate_text(rate)}"


def rate_value(text: str) -> float | None:
    """The rate a key's ``@r<text>`` names (``4``, ``0.5``), None when it is not a number > 0
    written without spaces."""
    try:
        rate = float(text)
    except ValueError:
        return None
    return rate if rate > 0 and text.strip() == text else None


@dataclass(frozen=True)
class FigureKey:
    """A parsed flat key: ``name`` at one ``level`` or at one ``rate`` (its text as written; it
    may differ from ``rate_text`` of its value, as ``4.0`` does: ``canonical`` says whether the
    figures are keyed so)."""

    name: str
    level: int | None = None
    rate: str | None = None

    def flat(self) -> str:
        """The key as the figures spell it (``rate_text`` of the rate)."""
        return level_key(self.name, self.level) if self.level is not None else \
            rate_key(self.name, self.rate)

    @property
    def canonical(self) -> bool:
        """Spelled as the figures are (``goodput@r4``, not ``goodput@r4.0``)."""
        return self.rate is None or self.rate == rate_text(self.rate)


def parse(key: str) -> FigureKey | None:
    """The name and level or rate of a flat key; None for any other key (``speedup``,
    ``quality_pass@1``, a level that is not an integer >= 1, a rate that is not a number > 0)."""
    name, at, suffix = str(key).rpartition("@")
    if not at or not name:
        return None
    kind, text = suffix[:1], suffix[1:]
    if kind == LEVEL[1:]:
        if text.isascii() and text.isdigit() and int(text) >= 1:
            return FigureKey(name, level=int(text))
        return None
    if kind == RATE[1:] and rate_value(text) is not None:
        return FigureKey(name, rate=text)
    return None


def split_level(key: str) -> tuple[str, int | None]:
    """(name, level) of a per-level key (``("decode_speedup", 4)``), (key, None) of any other
    (``("goodput@r4", None)``, ``("speedup", None)``)."""
    got = parse(key)
    return (got.name, got.level) if got is not None and got.level is not None else (key, None)


@dataclass(frozen=True)
class Figures:
    """A trial's per-level and per-rate figures, keyed by ``(name, level)`` and ``(name,
    rate_text(rate))``; every other key of the flat mapping it was read from is left out."""

    by_level: Mapping[tuple[str, int], Any] = field(default_factory=dict)
    by_rate: Mapping[tuple[str, str], Any] = field(default_factory=dict)

    @classmethod
    def from_flat(cls, flat: Mapping[str, Any]) -> Figures:
        """From flat keys (a trial's user attributes, a summary, a held-out confirmation)."""
        by_level: dict[tuple[str, int], Any] = {}
        by_rate: dict[tuple[str, str], Any] = {}
        for key, value in flat.items():
            got = parse(key)
            if got is None:
                continue
            if got.level is not None:
                by_level[got.name, got.level] = value
            else:
                by_rate[got.name, rate_text(got.rate)] = value
        return cls(by_level, by_rate)

    def flat(self) -> dict[str, Any]:
        """The flat keys again (those of every earlier study)."""
        return {**{level_key(name, level): v for (name, level), v in self.by_level.items()},
                **{rate_key(name, rate): v for (name, rate), v in self.by_rate.items()}}

    def at_level(self, name: str, level: int) -> Any:
        """``name`` at concurrency ``level`` (None: not measured there)."""
        return self.by_level.get((name, int(level)))

    def at_rate(self, name: str, rate: float | str) -> Any:
        """``name`` at request rate ``rate`` (None: not measured there)."""
        return self.by_rate.get((name, rate_text(rate)))

    def levels(self, name: str) -> tuple[int, ...]:
        """The levels ``name`` was measured at, ascending."""
        return tuple(sorted(level for n, level in self.by_level if n == name))

    def rates(self, name: str) -> tuple[str, ...]:
        """The rates ``name`` was measured at (as the keys spell them), ascending."""
        return tuple(sorted((rate for n, rate in self.by_rate if n == name), key=float))
