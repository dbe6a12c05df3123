"""Where scrapes come from: a live server's ``/metrics`` every interval, or a recording of one
(``--replay``), so every rule downstream runs the same on both.

A recording is JSON Lines (gzip-compressed where its name ends in ``.gz``), one scrape per line: ``{"at": <unix seconds>, "text": <the /metrics
text>}``, the text cut to the series the engine's ``LiveMetrics`` reads (``--record``: small
enough to commit). The first line may be a header ``{"recorded": {...}}`` saying what was
recorded (server, study, command); replay skips it.
"""

from __future__ import annotations

import json
import statistics
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tuner.config.errors import ConfigError
from tuner.engines.metrics import LiveMetrics, MetricsError, unsupported

MIN_INTERVAL_S = 0.1            # never scrape faster than this
COST_FACTOR = 3                 # the interval is at least this many times a scrape's cost


@dataclass(frozen=True)
class Raw:
    at: float                    # unix seconds
    text: str
    error: str = ""              # a live scrape that failed (the server restarting, a network
                                 # blip): what went wrong; ``text`` is then empty


class Unreachable(Exception):
    """Nothing answered a GET; the reason as the network gave it."""


class ServerGone(RuntimeError):
    """A watched server answered no scrape for ``GIVE_UP_S``: the watch ends (the message is
    its reason)."""


def get(url: str, timeout: float = 10.0) -> tuple[int, str]:
    """(HTTP status, body) of a GET; ``Unreachable`` where nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            return answer.status, answer.read().decode(errors="replace")
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as err:
        raise Unreachable(str(getattr(err, "reason", err))) from None


def fetch(url: str, timeout: float = 10.0) -> tuple[int, str]:
    """``get`` before watching: one ``ConfigError`` line where nothing answers."""
    try:
        return get(url, timeout)
    except Unreachable as err:
        raise ConfigError(f"--url={url.rsplit('/', 1)[0]!r} is unreachable ({err}): allowed "
                          "is the base URL of a running engine server, e.g. "
                          "http://127.0.0.1:8080") from None


def check_metrics(url: str, metrics: LiveMetrics, display: str) -> float:
    """One line unless ``url``'s ``/metrics`` is this engine's with speculative counters; the
    median seconds of three scrapes (its cost)."""
    costs, text = [], ""
    for _ in range(3):
        began = time.perf_counter()
        status, text = fetch(url + "/metrics")
        costs.append(time.perf_counter() - began)
        if status != 200:
            hint = f" ({metrics.flag_hint})" if metrics.flag_hint else ""
            raise ConfigError(f"--url={url!r}: /metrics answered HTTP {status} "
                              f"({text.strip()[:160]}): the server exports no metrics{hint}")
    check_text(text, metrics, display, f"--url={url!r}")
    return statistics.median(costs)


def check_text(text: str, metrics: LiveMetrics, display: str, where: str) -> None:
    """One line unless ``text`` is this engine's ``/metrics`` with speculative counters."""
    why = unsupported(text)
    if why:
        raise ConfigError(f"{where}: {why}")
    if metrics.prefix not in text:
        raise ConfigError(f"{where} does not export {display}'s metrics ({metrics.prefix}*): "
                          f"allowed is the {display} server the study's deployment runs")
    try:
        metrics.read(text)
    except MetricsError as err:
        raise ConfigError(f"{where}: {err}") from None


def check_interval(interval: float, cost_s: float) -> None:
    least = max(MIN_INTERVAL_S, COST_FACTOR * cost_s)
    if not interval >= least:
        raise ConfigError(f"--interval={interval:g} is below this server's scrape cost "
                          f"({1e3 * cost_s:.0f} ms per /metrics, x{COST_FACTOR}): allowed is "
                          f"--interval >= {least:.2f} s")


GIVE_UP_S = 300.0                # a server that answers no scrape for this long ends the watch


def live(url: str, interval: float, metrics: LiveMetrics,
         record: Path | None = None, header: Mapping[str, Any] | None = None,
         clock: Callable[[], float] = time.time, give_up_s: float = GIVE_UP_S) -> Iterator[Raw]:
    """A scrape of ``url`` every ``interval`` seconds, on a fixed beat (never drifting by the
    scrape's own time), until the caller stops; ``ServerGone`` once the server answered nothing
    for ``give_up_s`` (a failed scrape is yielded with its error: a restarting server answers
    again with lower counters, which the windows read as a restart); each recorded where
    ``record`` is given."""
    out = None
    if record is not None:
        record.parent.mkdir(parents=True, exist_ok=True)
        out = text_file(record, "w")
        out.write(json.dumps({"recorded": dict(header or {})}) + "\n")
    try:
        beat = time.monotonic()
        answered = time.monotonic()
        while True:
            try:
                status, text = get(url + "/metrics")
                error = "" if status == 200 else f"HTTP {status}"
            except Unreachable as err:
                text, error = "", str(err)
            at = clock()
            if error:
                if time.monotonic() - answered > give_up_s:
                    raise ServerGone(f"no answer from the server for {give_up_s:.0f} s "
                                     f"({error})")
                yield Raw(at, "", error)
                beat += interval
                time.sleep(max(beat - time.monotonic(), 0.0))
                continue
            answered = time.monotonic()
            if out is not None:
                out.write(json.dumps({"at": round(at, 3), "text": metrics.keep(text)}) + "\n")
                out.flush()
            yield Raw(at, text)
            beat += interval
            time.sleep(max(beat - time.monotonic(), 0.0))
    finally:
        if out is not None:
            out.close()


def replay(path: Path) -> Iterator[Raw]:
    """The scrapes of a recording, in order."""
    with text_file(path, "r") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except ValueError:
                raise ConfigError(f"--replay={str(path)!r}: line {number} is not JSON: allowed "
                                  "is a file written by --record") from None
            if "recorded" in entry:
                continue
            if "at" not in entry or "text" not in entry:
                raise ConfigError(f"--replay={str(path)!r}: line {number} is not a scrape "
                                  "({\"at\": ..., \"text\": ...}): allowed is a file written "
                                  "by --record")
            yield Raw(float(entry["at"]), str(entry["text"]))


def text_file(path: Path, mode: str):
    """``path`` opened as text, through gzip where its name ends in ``.gz``."""
    import gzip
    return gzip.open(path, mode + "t") if path.suffix == ".gz" else path.open(mode)


def check_recording(path: Path) -> int:
    """Read a recording through once: its number of scrapes; one line (``ConfigError``) where
    it is not text, is a damaged or cut-short gzip file, or holds a line that is not a scrape,
    so that a replay never ends in a traceback halfway."""
    import gzip
    import zlib
    where = f"--replay={str(path)!r}"
    try:
        header_of(path)
        return sum(1 for _ in replay(path))
    except UnicodeDecodeError:
        raise ConfigError(f"{where} is not text (a binary file): allowed is a file written by "
                          "--record (JSON Lines, gzip-compressed where its name ends in .gz)"
                          ) from None
    except (EOFError, gzip.BadGzipFile, zlib.error) as err:
        raise ConfigError(f"{where} is a damaged gzip file ({err}): allowed is a whole file "
                          "written by --record") from None


def header_of(path: Path) -> dict[str, Any]:
    """A recording's header (``{}`` where it has none)."""
    with text_file(path, "r") as lines:
        first = lines.readline()
    try:
        entry = json.loads(first) if first.strip() else {}
    except ValueError:
        raise ConfigError(f"--replay={str(path)!r} is not JSON Lines: allowed is a file "
                          "written by --record") from None
    return dict(entry.get("recorded") or {})
