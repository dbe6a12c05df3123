"""Bounded client load for the watch's live tests and recordings: phases of prompts sent to a real
engine server by a few threads, each phase bounded in time and in requests. A phase may also end
on a condition (``done``: e.g. once the watch has closed enough windows), so that what a test
needs before a switch does not depend on how fast the machine is; its seconds are then its cap.

Three workloads from the repository's data: *extractive* (a CNN/DailyMail article to repeat word
for word: prompt lookup finds nearly every token in the prompt), *summaries* (the articles to
summarize: many drafts, most rejected) and *open* (MT-Bench's first turns: little to look up).
Loopback servers only.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def extractive(n: int) -> list[str]:
    rows = [json.loads(line) for line in (ROOT / "data/cnndm/test_100.jsonl").open()][:n]
    return [f"Repeat the text below word for word.\n\n{r['article'][:700]}\n\nThe text, "
            f"repeated word for word:\n{r['article'][:80]}" for r in rows]


def summaries(n: int) -> list[str]:
    """A CNN/DailyMail article to summarize: prompt lookup finds many of the article's n-grams,
    but the summary rarely continues them (most drafts are rejected)."""
    rows = [json.loads(line) for line in (ROOT / "data/cnndm/test_100.jsonl").open()][:n]
    return [f"Summarize the article below in three sentences.\n\n{r['article'][:1500]}\n\n"
            "Summary:" for r in rows]


def open_ended(n: int) -> list[str]:
    rows = [json.loads(line) for line in (ROOT / "data/mtbench/question.jsonl").open()][:n]
    return [f"{r['turns'][0]}\n\nAnswer:" for r in rows]


def request_for(engine: str, max_tokens: int) -> Callable[[str], tuple[str, dict]]:
    """(path, body) of one greedy generation request of ``engine``'s server."""
    if engine == "llamacpp":
        return lambda prompt: ("/completion", {"prompt": prompt, "n_predict": max_tokens,
                                               "temperature": 0.0, "cache_prompt": False})
    if engine == "vllm":
        return lambda prompt: ("/v1/completions", {"model": "target", "prompt": prompt,
                                                   "max_tokens": max_tokens,
                                                   "temperature": 0.0, "ignore_eos": True})
    raise ValueError(engine)


class Load:
    """Phases of requests in a background thread (``start``); ``phase`` names the one running.

    A phase is ``(name, prompts, seconds)`` or ``(name, prompts, seconds, done)``: it ends after
    ``seconds`` or, sooner, once ``done()`` is true (checked before each request)."""

    def __init__(self, url: str, engine: str,
                 phases: Sequence[tuple[str, list[str], float]
                                  | tuple[str, list[str], float, Callable[[], bool]]],
                 workers: int = 2, max_tokens: int = 64, max_requests: int = 400) -> None:
        self.url, self.phases, self.workers = url.rstrip("/"), list(phases), workers
        self.request = request_for(engine, max_tokens)
        self.max_requests = max_requests
        self.sent = 0
        self.phase = ""
        self.switched_at: dict[str, float] = {}
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def start(self) -> Load:
        self.thread.start()
        return self

    def one(self, prompt: str) -> None:
        path, body = self.request(prompt)
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as answer:
                answer.read()
        except OSError as err:              # e.g. the server restarting: back off a little
            self.errors.append(str(err))
            self.stop.wait(0.25)

    def run(self) -> None:
        lock = threading.Lock()
        for name, prompts, seconds, *condition in self.phases:
            self.phase, self.switched_at[name] = name, time.time()
            until = time.monotonic() + seconds
            done = condition[0] if condition else (lambda: False)
            counter = iter(range(10 ** 9))

            def worker(until: float = until, prompts: list[str] = prompts,
                       counter=counter, done: Callable[[], bool] = done) -> None:
                while not self.stop.is_set() and time.monotonic() < until and not done():
                    with lock:
                        if self.sent >= self.max_requests:
                            return
                        i = next(counter)
                        self.sent += 1
                    self.one(prompts[i % len(prompts)])

            threads = [threading.Thread(target=worker, daemon=True)
                       for _ in range(self.workers)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if self.stop.is_set():
                return
        self.phase = "done"

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=180)
