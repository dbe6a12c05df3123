"""Send an arrival schedule to an engine server and time every streamed token (aiohttp, async).

``send_schedule(url, payloads, offsets, parse)`` sends payload i at ``offsets[i]`` seconds after
the start whether or not earlier requests have finished (open loop), each as a streaming request
(server-sent events: ``data: {...}`` lines), and records when each token arrived
(``tuner.measure.traffic.StreamedRequest``). One asyncio loop, one connection per request in
flight (``limit=0``: a connection pool would queue requests the schedule says are in flight).
Bounded: loopback only, at most ``MAX_REQUESTS`` requests, every request and the whole schedule
under a timeout, after which the schedule fails (and the trial with it) instead of the study.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Callable, Mapping, Sequence
from urllib.parse import urlsplit

from tuner.engines.client import REQUEST_TIMEOUT_S, RequestFailed
from tuner.measure.traffic import MAX_REQUESTS, StreamedRequest

LOOPBACK = ("127.0.0.1", "localhost", "::1")

# an answer's event -> (the token ids it carries, the tokens generated so far by the server's own
# count, or None where it gives none, whether it is the last event); raises RequestFailed for an
# error the server sends inside the stream
Parse = Callable[[Mapping[str, Any]], tuple[Sequence[int], "int | None", bool]]
READ_BUFSIZE = 1 << 22          # a final event may echo a long prompt: lines up to 8 MiB


def arrived(seen: int, ids: Sequence[int], total: int | None) -> int:
    """Tokens that arrived with an event: by the server's running count where it gives one (an
    event may hold back a token that ends inside a multi-byte character and the next carry only
    its own id: the count still says two), else the ids it carries."""
    return max(total - seen, 0) if total is not None else len(ids)


def send_schedule(url: str, payloads: Sequence[Mapping[str, Any]], offsets: Sequence[float],
                  parse: Parse, timeout_s: float = REQUEST_TIMEOUT_S) -> list[StreamedRequest]:
    """Every payload at its offset (seconds from the start); the requests in schedule order."""
    if len(payloads) != len(offsets) or not payloads:
        raise ValueError(f"{len(payloads)} payloads for {len(offsets)} send times")
    if len(payloads) > MAX_REQUESTS:
        raise ValueError(f"{len(payloads)} requests: at most {MAX_REQUESTS} per schedule")
    if urlsplit(url).hostname not in LOOPBACK:
        raise ValueError(f"{url}: schedules go to servers on loopback only")
    deadline = max(offsets) + timeout_s
    return asyncio.run(_schedule(url, payloads, offsets, parse, timeout_s, deadline))


async def _schedule(url: str, payloads: Sequence[Mapping[str, Any]], offsets: Sequence[float],
                    parse: Parse, timeout_s: float, deadline: float) -> list[StreamedRequest]:
    import aiohttp
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout,
                                     read_bufsize=READ_BUFSIZE) as session:
        start = time.perf_counter()
        tasks = [asyncio.create_task(_one(session, url, i, payload, offset, start, parse))
                 for i, (payload, offset) in enumerate(zip(payloads, offsets))]
        try:
            return list(await asyncio.wait_for(asyncio.gather(*tasks), deadline))
        except asyncio.TimeoutError:
            raise RequestFailed(f"POST {url}: the schedule of {len(payloads)} requests did not "
                                f"finish within {deadline:.0f} s") from None
        finally:
            for task in tasks:
                task.cancel()


async def _one(session: Any, url: str, index: int, payload: Mapping[str, Any], offset: float,
               start: float, parse: Parse) -> StreamedRequest:
    import aiohttp
    delay = start + offset - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    sent = time.perf_counter() - start
    times: list[float] = []
    tokens: list[int] = []
    last = False
    try:
        async with session.post(url, json=dict(payload)) as answer:
            if answer.status != 200:
                detail = (await answer.text())[:500]
                raise RequestFailed(f"POST {url}: HTTP {answer.status}: {detail}")
            async for raw in answer.content:              # one SSE line at a time
                line = raw.strip()
                if line.startswith(b"error:"):            # some servers' error event
                    raise RequestFailed(f"POST {url}: the server stopped the stream: "
                                        f"{line[6:].strip().decode(errors='replace')[:300]}")
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":                     # OpenAI-style end of a whole answer
                    last = True
                    break
                ids, total, last = parse(json.loads(data))
                now = time.perf_counter() - start
                times += [now] * arrived(len(times), ids, total)
                tokens += [int(t) for t in ids]
                if last:
                    break
    except (aiohttp.ClientError, aiohttp.http_exceptions.HttpProcessingError,
            asyncio.TimeoutError, OSError, ValueError) as err:
        raise RequestFailed(f"POST {url}: {type(err).__name__}: {err}") from None
    if not last:
        raise RequestFailed(f"POST {url}: request {index} of the schedule ended before its last "
                            f"event ({len(times)} tokens in)")
    return StreamedRequest(index, offset, sent, tuple(times), tuple(tokens))
