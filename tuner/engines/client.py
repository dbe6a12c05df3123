"""A bounded HTTP client for engine servers: one request, or a batch sent at once.

``send_batch(url, payloads)`` opens one connection per payload and sends them together (one thread
each, so exactly ``len(payloads)`` requests are in flight), then waits for every answer. Each
``Reply`` carries the client's own wall time of its request; the batch's wall time is from the
first send to the last answer (what a client of that concurrency sees as throughput). Loopback
only; every request has a timeout, so a hung server fails the trial instead of the study.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

REQUEST_TIMEOUT_S = 600.0       # one generation; far beyond any budget this tuner runs


class RequestFailed(RuntimeError):
    """The server answered with an error status, or not at all."""


@dataclass(frozen=True)
class Reply:
    body: dict[str, Any]        # the server's JSON answer
    sent: float                 # time.perf_counter() when the request was sent
    wall_s: float               # until the whole answer was read


def post(url: str, payload: Mapping[str, Any], timeout: float = REQUEST_TIMEOUT_S) -> Reply:
    data = json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    sent = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            body = json.loads(answer.read())
    except urllib.error.HTTPError as err:
        detail = err.read().decode(errors="replace")[:500]
        raise RequestFailed(f"POST {url}: HTTP {err.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as err:
        raise RequestFailed(f"POST {url}: {err}") from None
    return Reply(body, sent, time.perf_counter() - sent)


def get_text(url: str, timeout: float = 10.0) -> str:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            return answer.read().decode()
    except (urllib.error.URLError, OSError) as err:
        raise RequestFailed(f"GET {url}: {err}") from None


def send_batch(url: str, payloads: Sequence[Mapping[str, Any]],
               timeout: float = REQUEST_TIMEOUT_S) -> tuple[list[Reply], float]:
    """Every payload in flight at once; the replies in payload order and the batch's wall time."""
    if len(payloads) == 1:
        reply = post(url, payloads[0], timeout)
        return [reply], reply.wall_s
    replies: list[Reply | None] = [None] * len(payloads)
    errors: list[BaseException] = []
    start = threading.Barrier(len(payloads))

    def one(i: int) -> None:
        start.wait()
        try:
            replies[i] = post(url, payloads[i], timeout)
        except BaseException as err:   # noqa: BLE001 - re-raised in the caller's thread
            errors.append(err)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(payloads))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    if errors:
        raise errors[0]
    if any(r is None for r in replies):
        raise RequestFailed(f"POST {url}: no answer within {timeout:.0f} s")
    first = min(r.sent for r in replies)
    return list(replies), max(r.sent + r.wall_s for r in replies) - first
