"""Cost surfaces and hardware profiles: seconds per model forward as a function of the tokens it
takes and the context it attends to, measured once on one machine, stored as versioned JSON, read
on any other.

A ``CostSurface`` is one model's forward time on one machine:
  * ``seconds[i][j]``: the median wall time of a KV-cached forward of ``rows[j]`` tokens after
    ``contexts[i]`` cached tokens (a decode or verification step: vanilla feeds 1 row, a chain
    with γ drafts γ + 1, a tree its nodes + 1);
  * ``prefill``: (prompt tokens, seconds) of a forward over a whole prompt with an empty cache.
Between grid points it interpolates linearly (bilinearly on the grid); below the grid it takes
the first value, above it extends the last segment (never below the last value).

A ``HardwareProfile`` holds the target's surface and, for methods with a draft model, the draft's,
plus what they were measured on (machine, engine and its build, threads, models and dtypes, when)
and ``step_overhead_s``: the loop's own time per step beyond its forwards (verification, Python;
with a draft model also the slowdown of forwards interleaved with the target's), with its spread
and the ``flags`` its fit got when it was made (``tuner.predict.check``).
``batches`` (optional): the same surfaces at further batch sizes (every sequence of the batch
feeds the cell's rows after the cell's context), for predictions per batch size
(``at_batch``; a roofline writes them, ``tuner.predict.roofline``).
``load_profile`` refuses with one line a file that is not a profile of this version, or one made
for other models or another engine than the caller names.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from tuner.config.errors import ConfigError

PROFILE_VERSION = 1
PROFILE_KINDS = ("measured", "roofline")


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (xs, ys) (xs ascending); below the grid the first value, above
    it the last segment extended (never below the last value)."""
    if len(xs) == 1 or x <= xs[0]:
        return float(ys[0])
    i = min(bisect.bisect_right(xs, x) - 1, len(xs) - 2)
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    value = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return max(value, float(ys[-1])) if x > xs[-1] else value


@dataclass(frozen=True)
class CostSurface:
    """One model's forward time on one machine (see the module docstring)."""

    contexts: tuple[int, ...]                    # [C] cached tokens before the forward
    rows: tuple[int, ...]                        # [R] tokens fed in the forward
    seconds: tuple[tuple[float, ...], ...]       # [C][R] median seconds
    prefill: tuple[tuple[int, float], ...] = ()  # (prompt tokens, seconds), ascending

    def __post_init__(self) -> None:
        if not self.contexts or not self.rows:
            raise ValueError("a cost surface needs at least one context and one row count")
        if list(self.contexts) != sorted(set(self.contexts)) or \
                list(self.rows) != sorted(set(self.rows)):
            raise ValueError("a cost surface's contexts and rows must ascend without repeats")
        if len(self.seconds) != len(self.contexts) or \
                any(len(line) != len(self.rows) for line in self.seconds):
            raise ValueError(f"a cost surface of {len(self.contexts)} contexts x "
                             f"{len(self.rows)} rows needs that many seconds")
        if any(not (s > 0) for line in self.seconds for s in line) or \
                any(not (s > 0) for _, s in self.prefill):
            raise ValueError("a cost surface's seconds must be positive")

    def step_s(self, context: int, rows: int) -> float:
        """Seconds of a forward of ``rows`` tokens after ``context`` cached ones."""
        per_context = [_interp(self.rows, line, rows) for line in self.seconds]
        return _interp(self.contexts, per_context, context)

    def prefill_s(self, tokens: int) -> float:
        """Seconds of a forward over ``tokens`` prompt tokens (empty cache); from the decode grid
        at context 0 where no prefill was measured."""
        if not self.prefill:
            return self.step_s(0, tokens)
        return _interp([n for n, _ in self.prefill], [s for _, s in self.prefill], tokens)

    def same_grid(self, other: CostSurface) -> bool:
        return (self.contexts, self.rows) == (other.contexts, other.rows) and \
            [n for n, _ in self.prefill] == [n for n, _ in other.prefill]

    def blend(self, other: CostSurface, weight: float) -> CostSurface:
        """(1 − weight) · self + weight · other, cell by cell (the same grid)."""
        if not self.same_grid(other):
            raise ValueError("surfaces on different grids cannot be blended")
        mix = lambda a, b: (1.0 - weight) * a + weight * b   # noqa: E731
        return CostSurface(self.contexts, self.rows,
                           tuple(tuple(mix(a, b) for a, b in zip(x, y))
                                 for x, y in zip(self.seconds, other.seconds)),
                           tuple((n, mix(a, b)) for (n, a), (_, b) in
                                 zip(self.prefill, other.prefill)))

    def to_json(self) -> dict[str, Any]:
        return {"contexts": list(self.contexts), "rows": list(self.rows),
                "seconds": [list(line) for line in self.seconds],
                "prefill": [list(p) for p in self.prefill]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CostSurface:
        return cls(tuple(int(c) for c in data["contexts"]), tuple(int(r) for r in data["rows"]),
                   tuple(tuple(float(s) for s in line) for line in data["seconds"]),
                   tuple((int(n), float(s)) for n, s in data.get("prefill") or ()))


@dataclass(frozen=True)
class HardwareProfile:
    """Cost surfaces of a target (and its draft) on one machine and engine (module docstring)."""

    kind: str                                  # "measured", or "roofline" (an estimate)
    machine: str                               # the CPU's or GPU's name
    engine: str                                # "hf": our own loops
    build: Mapping[str, str]                   # torch, transformers versions (or the engine's)
    threads: int
    models: Mapping[str, Any]                  # {"target": spec, "draft": spec or None}
    target: CostSurface
    draft: CostSurface | None = None
    # the loop's seconds per step beyond the surface's forwards: vanilla, loop, draft_loop
    step_overhead_s: Mapping[str, float] = field(default_factory=dict)
    made: str = ""                             # ISO time (UTC)
    note: str = ""                             # e.g. how a roofline was computed
    version: int = PROFILE_VERSION
    # (batch size, target, draft) ascending: the surfaces per batch size, batch 1 first; empty
    # where only batch 1 was measured (``target`` / ``draft``)
    batches: tuple[tuple[int, CostSurface, CostSurface | None], ...] = ()
    # the overheads' spread (``tuner.predict.loops.LoopFit.spread``): empty in a profile made
    # before fits kept it
    step_overhead_spread_s: Mapping[str, float] = field(default_factory=dict)
    # why the fit is not to be believed, one line each (``tuner.predict.check.fit_flags``)
    flags: tuple[str, ...] = ()

    def batch_sizes(self) -> tuple[int, ...]:
        return tuple(b for b, _, _ in self.batches) or (1,)

    def at_batch(self, batch: int) -> HardwareProfile:
        """This profile with its surfaces at ``batch`` (linear between the stored batch sizes);
        ValueError outside them."""
        sizes = self.batch_sizes()
        if not sizes[0] <= batch <= sizes[-1]:
            raise ValueError(f"batch size {batch} is outside this profile's batch sizes "
                             f"{list(sizes)}")
        if not self.batches:
            return self
        i = max(k for k, b in enumerate(sizes) if b <= batch)
        lo, target, draft = self.batches[i]
        if lo != batch:
            hi, target_hi, draft_hi = self.batches[i + 1]
            weight = (batch - lo) / (hi - lo)
            target = target.blend(target_hi, weight)
            draft = draft.blend(draft_hi, weight) if draft is not None and \
                draft_hi is not None else None
        return replace(self, target=target, draft=draft, batches=())

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["target"] = self.target.to_json()
        out["draft"] = self.draft.to_json() if self.draft is not None else None
        out["batches"] = [{"batch": b, "target": t.to_json(),
                           "draft": d.to_json() if d is not None else None}
                          for b, t, d in self.batches]
        out["flags"] = list(self.flags)
        return out

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path

    def describe(self) -> str:
        what = "an ESTIMATE (roofline, not measured)" if self.kind == "roofline" else "measured"
        return (f"{what} on {self.machine}, engine {self.engine}, {self.threads} threads, "
                f"made {self.made or '?'}" + (", FLAGGED when made" if self.flags else ""))


def model_key(spec: Mapping[str, Any] | None) -> Any:
    """What identifies a model in a profile: its spec without where it runs."""
    if spec is None:
        return None
    return {k: v for k, v in sorted(dict(spec).items()) if k not in ("device",)}


def load_profile(path: str | Path, *, models: Mapping[str, Any] | None = None,
                 engine: str | None = None, setting: str = "search.predict_for"
                 ) -> HardwareProfile:
    """A profile from ``path``; one ``ConfigError`` line for a missing or corrupt file, another
    version, or (when given) other models or another engine than ``models`` / ``engine``."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as err:
        raise ConfigError(f"{setting}={str(path)!r}: cannot read it ({err.strerror or err}): "
                          "allowed is a hardware profile JSON (python -m tuner.profile)") from None
    except ValueError as err:
        raise ConfigError(f"{setting}={str(path)!r} is not JSON ({err}): allowed is a hardware "
                          "profile written by python -m tuner.profile") from None
    if not isinstance(data, dict) or data.get("version") != PROFILE_VERSION:
        found = data.get("version") if isinstance(data, dict) else type(data).__name__
        raise ConfigError(f"{setting}={str(path)!r} is not a hardware profile of version "
                          f"{PROFILE_VERSION} (found version {found!r}): make it again with "
                          "python -m tuner.profile")
    try:
        profile = HardwareProfile(
            kind=str(data["kind"]), machine=str(data["machine"]), engine=str(data["engine"]),
            build=dict(data["build"]), threads=int(data["threads"]), models=dict(data["models"]),
            target=CostSurface.from_json(data["target"]),
            draft=CostSurface.from_json(data["draft"]) if data.get("draft") else None,
            step_overhead_s={k: float(v) for k, v in (data.get("step_overhead_s") or {}).items()},
            step_overhead_spread_s={k: float(v) for k, v in
                                    (data.get("step_overhead_spread_s") or {}).items()},
            flags=tuple(str(f) for f in data.get("flags") or ()),
            made=str(data.get("made", "")), note=str(data.get("note", "")),
            batches=tuple((int(b["batch"]), CostSurface.from_json(b["target"]),
                           CostSurface.from_json(b["draft"]) if b.get("draft") else None)
                          for b in data.get("batches") or ()))
        sizes = [b for b, _, _ in profile.batches]
        if sizes and (sizes != sorted(set(sizes)) or sizes[0] != 1):
            raise ValueError(f"batch sizes {sizes} must ascend from 1")
        first = profile.batches[0] if profile.batches else None
        if first is not None and any(                  # at_batch blends neighbours cell by cell
                not t.same_grid(first[1]) or (d is not None and first[2] is not None and
                                              not d.same_grid(first[2]))
                for _, t, d in profile.batches):
            raise ValueError("its batch sizes' surfaces are on different grids")
    except (KeyError, TypeError, ValueError) as err:
        raise ConfigError(f"{setting}={str(path)!r} is a corrupt hardware profile "
                          f"({type(err).__name__}: {err}): make it again with "
                          "python -m tuner.profile") from None
    if profile.kind not in PROFILE_KINDS:
        raise ConfigError(f"{setting}={str(path)!r} has kind={profile.kind!r}: allowed are "
                          f"{list(PROFILE_KINDS)}")
    if engine is not None and profile.engine != engine:
        raise ConfigError(f"{setting}={str(path)!r} was made for engine={profile.engine}, not "
                          f"engine={engine}: allowed is a profile of the engine being tuned")
    if models is not None:
        for role in ("target", "draft"):
            want, have = model_key(models.get(role)), model_key(profile.models.get(role))
            if role == "draft" and want is None:
                continue                        # a method without a draft reads the target only
            if want != have:
                raise ConfigError(f"{setting}={str(path)!r} was made for models.{role}={have}, "
                                  f"not {want}: allowed is a profile of the models being tuned")
    return profile
