"""``search.profile=auto``: this machine's profile of our own loops, made on first use and cached.

A study that ranks by prediction needs a hardware profile (``tuner.predict.surface``). With
``search.profile=auto`` (the default of ``search=predict``) the user never has to know about
``python -m tuner.profile``: the study looks for a profile made here for the same models, the
same engine (our own loops), the same thread count and the same build (torch, transformers,
Python); where there is none, it makes one before the models load for the trials, says so with
its time, and caches it. A profile whose fit was flagged when it was made (``fit_flags``) is
made again once, then refused in one line. Every study still checks the profile against its
trial 0 (``tuner.search.ranking``); with ``auto`` a failed check remakes the profile once too.

Cached under ``$SPECTUNE_PROFILES`` (default ``~/.cache/spectune/profiles/``), one JSON file per
key: ``<models' target kind>-<8 hex of machine, models, engine, threads, build>.json``.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from tuner.config.errors import ConfigError
from tuner.config.identity import short_hash

if TYPE_CHECKING:
    from tuner.predict.surface import HardwareProfile

AUTO = "auto"
PROFILE_USED = "profile_used"  # study user attr: the profile a study priced by (auto: its file)


def thread_count(threads: Any) -> int:
    """The torch thread count a study's ``threads`` setting gives (auto: one per allowed CPU)."""
    from tuner.measure.hygiene import thread_count as count
    try:
        return count(None if threads == "auto" else threads)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def cache_folder() -> Path:
    return Path(os.environ.get("SPECTUNE_PROFILES") or
                Path.home() / ".cache" / "spectune" / "profiles")


def build() -> dict[str, str]:
    """What runs the loops (part of the key: a new torch can change every forward's price)."""
    import torch
    import transformers
    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}


@dataclass(frozen=True)
class Key:
    """What a cached profile must match to be used: machine, models, engine, threads, build."""

    machine: str
    models: Mapping[str, Any]          # tuner.predict.loops.describe_models
    engine: str                        # our own loops' engine name (tuner.engines.DEFAULT)
    threads: int
    build: Mapping[str, str]

    @classmethod
    def here(cls, models: Mapping[str, Any], engine: str, threads: int) -> Key:
        """The key of this machine for ``models`` (target/draft specs) in ``engine`` (our own
        loops') at ``threads``."""
        from decoding.hardware import hardware
        from decoding.models import resolve_device
        from tuner.predict.loops import describe_models
        device = resolve_device(models["target"].get("device"))
        return cls(hardware(device), describe_models(models), engine, int(threads), build())

    def path(self) -> Path:
        digest = short_hash({"machine": self.machine, "models": dict(self.models),
                             "engine": self.engine, "threads": self.threads,
                             "build": dict(self.build)})
        kind = str(self.models["target"].get("package") or self.models["target"].get("kind"))
        return cache_folder() / f"{kind}-{digest}.json"

    def matches(self, profile: HardwareProfile) -> bool:
        return (profile.kind == "measured" and profile.machine == self.machine and
                profile.engine == self.engine and profile.threads == self.threads and
                dict(profile.models) == json.loads(json.dumps(dict(self.models))) and
                dict(profile.build) == dict(self.build))


def cached(key: Key) -> HardwareProfile | None:
    """The cached profile for ``key``: None where there is none, it does not load, it was made
    for another key, or its fit was flagged (it is made again)."""
    from tuner.predict.surface import load_profile
    path = key.path()
    if not path.is_file():
        return None
    try:
        profile = load_profile(str(path), setting="search.profile=auto")
    except (ConfigError, ValueError, OSError, KeyError):
        return None
    return profile if key.matches(profile) and not profile.flags else None


def measure_loops_profile(models: Mapping[str, Any], engine: str, threads: int | str | None,
                          repeats: int, say: Callable[[str], None] = print,
                          between_rounds: Callable[[int], None] = lambda round_: None,
                          contexts: tuple[int, ...] | None = None,
                          rows: tuple[int, ...] | None = None,
                          draft_rows: tuple[int, ...] | None = None,
                          prefill: tuple[int, ...] | None = None) -> HardwareProfile:
    """Our own loops' profile on this machine: surfaces and overhead fit timed in interleaved
    rounds (``tuner.predict.loops.measure_profile``), the fit checked
    (``tuner.predict.check.fit_flags``: its lines go into the profile's ``flags``); the grids
    default to ``tuner.predict.loops``'. Raises ``loops.ProfileDisturbed`` under sustained
    load. (``python -m tuner.profile`` and ``search.profile=auto`` both make it here.)"""
    from decoding.hardware import hardware
    from decoding.models import load_pair
    from tuner.measure.hygiene import configure_threads
    from tuner.predict import loops
    from tuner.predict.check import fit_flags
    from tuner.predict.surface import HardwareProfile
    threads = configure_threads(None if threads == "auto" else threads)
    draft_spec = models.get("draft") or {"kind": "none"}
    pair = load_pair(models["target"], draft_spec)
    device = next(pair.target.parameters()).device
    say(f"profiling {pair.target_name}" + (f" and its draft {pair.draft_name}" if pair.draft
                                            is not None else "") +
        f" on {hardware(device)}, {threads} threads: {repeats} rounds after a warm-up "
        "round, each timing every forward cell and every loop's overhead run once")
    target, draft, fit = loops.measure_profile(
        pair.target, pair.draft, contexts=tuple(contexts or loops.CONTEXTS),
        rows=tuple(rows or loops.TARGET_ROWS), draft_rows=tuple(draft_rows or loops.DRAFT_ROWS),
        prefill=tuple(prefill or loops.PREFILL), repeats=repeats, progress=say,
        between_rounds=between_rounds)
    return HardwareProfile(
        kind="measured", machine=hardware(device), engine=engine, build=build(),
        threads=threads, models=loops.describe_models(models), target=target, draft=draft,
        step_overhead_s=fit.values(), step_overhead_spread_s=fit.spreads(),
        flags=tuple(fit_flags(fit)),
        made=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


@dataclass(frozen=True)
class Obtained:
    """The profile ``obtain`` gave: where it is cached, whether it was made now, in how long."""

    profile: HardwareProfile
    path: Path
    made_now: bool
    seconds: float

    def record(self) -> dict[str, Any]:
        """What the study keeps of it (``PROFILE_USED``): enough to find and reproduce it."""
        return {"setting": AUTO, "path": str(self.path), "made": self.profile.made,
                "machine": self.profile.machine, "threads": self.profile.threads,
                "build": dict(self.profile.build), "made_now": self.made_now,
                "seconds": round(self.seconds, 1)}


def obtain(models: Mapping[str, Any], engine: str, threads: int, say: Callable[[str], None],
           repeats: int = 5, remake: bool = False,
           measure: Callable[..., HardwareProfile] = measure_loops_profile,
           found: HardwareProfile | None = None) -> Obtained:
    """The cached profile for ``models`` at ``threads`` on this machine (``found``: already
    read from the cache), or one made now (and cached); ``remake``: make it again whatever the
    cache holds. A profile whose fit is flagged
    is made once more; flagged again, or stopped by sustained load, it is refused in one line
    (``ConfigError``), nothing cached."""
    from tuner.predict.loops import ProfileDisturbed
    key = Key.here(models, engine, threads)
    path = key.path()
    if not remake:
        found = found or cached(key)      # the settings' read of the cache, or read it now
        if found is not None:
            say(f"search.profile=auto: {path} (made {found.made} on {found.machine}, "
                f"{found.threads} threads)")
            return Obtained(found, path, False, 0.0)
    why = "making the profile again" if remake else "no profile of these models here yet"
    say(f"search.profile=auto: {why} ({key.machine}, {threads} threads): making one now, as "
        f"python -m tuner.profile does ({repeats} rounds; a quiet machine is needed) ...")
    began = time.perf_counter()
    for attempt in (1, 2):
        try:
            profile = measure(models, engine, threads, repeats, say=say)
        except ProfileDisturbed as err:
            raise ConfigError(f"search.profile=auto: the profile could not be made: {err}; "
                              "run again on a quiet machine, or give search.profile=<file>"
                              ) from None
        if not profile.flags:
            break
        if attempt == 2:
            raise ConfigError(f"search.profile=auto: the profile made here was flagged twice "
                              f"({profile.flags[0]}): nothing cached; run again on a quiet "
                              "machine (check uptime), or give search.profile=<file>")
        say(f"search.profile=auto: the profile was flagged ({profile.flags[0]}): making it "
            "again once")
    seconds = time.perf_counter() - began
    profile.save(path)
    say(f"search.profile=auto: made in {seconds:.0f} s, cached at {path}")
    return Obtained(profile, path, True, seconds)
