"""Untimed runs on every core: forked worker processes, one thread each, a point pinned to one.

A ranking's untimed runs (``tuner.predict.halving``: lookahead, Ouroboros, SpecInfer, MJSD,
dynamic trees' drafts) are never timed: what they give is a method's steps and the shapes of
its forwards, deterministic at T = 0. So they need not run at the timed runs' thread count, and
the CPUs can share them out. On a 2-core CPU a small model's batch-1 forward gains little from a
second thread (SmolLM2-135M: 1.2x), so two one-thread processes run about 1.5x as many untimed
runs in the same time as one two-thread process (docs/benchmarks.md). The timed runs keep the
study's own thread count: the workers are children of the study's process, which waits for
them, and they end before the next timed run.

How: the study's process forks ``count`` workers once per ranking (its models and methods are
shared copy-on-write, nothing is loaded again); each sets one intra-op thread and ignores Ctrl-C
(the study's process handles it and stops them). Each round's runs are shared out so that the
workers get as many as they can; a point whose method keeps history across prompts (Ouroboros
with its pool: ``keeps_history``) stays with the worker of its first run, so its history
carries prompt after prompt exactly as in one process; any other point goes where there is
room. A worker's lines (what a
point's failure says) come back with its result and are said by the study's process. A worker
that dies loses its points' predictions (they rank last, as any failed prediction), never the
study. Forking is for CPUs only: on CUDA (a context cannot cross a fork) the runs stay in the
study's process (``worker_count``).
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import Any, Callable, Sequence

STOP_S = 10.0          # how long a worker has to end once asked, before it is killed


@dataclass(frozen=True)
class Done:
    """One untimed run's answer from a worker (or the study's process)."""

    value: Any                  # what the run returned (None where it failed)
    error: str | None           # "<Type>: <message>" where it raised
    lines: tuple[str, ...]      # what it said, in order


def worker_count(setting: Any, cpus: int, device_type: str) -> int:
    """``search.untimed_workers`` resolved: ``auto`` is one worker per CPU the study may use
    on a CPU device and none (the study's own process) on an accelerator; an integer is that
    many (1: the study's own process)."""
    if setting in (None, "auto"):
        return cpus if device_type == "cpu" and cpus > 1 else 1
    return int(setting)


def attempt(run: Callable[[int, int, Callable[[str], None]], Any], j: int, k: int) -> Done:
    """``run(j, k, say)`` with what it says collected and what it raises caught."""
    lines: list[str] = []
    try:
        return Done(run(j, k, lines.append), None, tuple(lines))
    except Exception as err:          # noqa: BLE001 - one point's failure loses its rank
        return Done(None, f"{type(err).__name__}: {err}", tuple(lines))


class UntimedWorkers:
    """``count`` forked workers that run ``run(j, k, say)`` (point j on prompt k) for the
    study's process (module docstring); a context manager: every worker ends on the way out."""

    def __init__(self, count: int, run: Callable[[int, int, Callable[[str], None]], Any]) -> None:
        if count < 2:
            raise ValueError(f"count={count}: untimed workers need at least 2 (1 runs in process)")
        self.count, self.run = count, run
        self.workers: list[tuple[Any, Any]] = []     # (process, connection)
        self.dead: set[int] = set()                  # workers that ended early
        self.home: dict[int, int] = {}               # point -> the worker that ran it last

    def __enter__(self) -> UntimedWorkers:
        import multiprocessing
        context = multiprocessing.get_context("fork")
        for _ in range(self.count):
            mine, theirs = context.Pipe()
            process = context.Process(target=self._serve, args=(theirs, mine), daemon=True)
            process.start()
            theirs.close()
            self.workers.append((process, mine))
        return self

    def _serve(self, connection: Any, parents: Any) -> None:
        """A worker's loop (in the child): one thread, Ctrl-C left to the study's process."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        parents.close()
        import torch
        torch.set_num_threads(1)
        code = 0
        try:
            while True:
                job = connection.recv()
                if job is None:
                    break
                j, k = job
                connection.send((j, k, attempt(self.run, j, k)))
        except (EOFError, OSError, KeyboardInterrupt):
            code = 1
        finally:
            os._exit(code)                # never the study's own exit handlers (a forked copy)

    def place(self, jobs: Sequence[tuple[int, int]], stays: Callable[[int], bool]
              ) -> list[int]:
        """The worker of each of ``jobs``: a point that ``stays`` (its history is there) where
        it ran before; the others, in order, to the live worker with the fewest runs so far."""
        live = [w for w in range(self.count) if w not in self.dead] or [0]
        load = {w: 0 for w in live}
        placed: list[int | None] = []
        for j, _ in jobs:
            w = self.home.get(j) if stays(j) else None
            placed.append(w)
            if w in load:
                load[w] += 1
        out = []
        for (j, _), w in zip(jobs, placed):
            if w is None:
                w = min(live, key=lambda v: (load[v], v))
                load[w] += 1
            self.home[j] = w
            out.append(w)
        return out

    def run_round(self, jobs: Sequence[tuple[int, int]],
                  stays: Callable[[int], bool] = lambda j: True
                  ) -> dict[tuple[int, int], Done]:
        """Every (j, k) of ``jobs`` (each j at most once) on its worker (``place``); their
        answers. ``stays(j)``: whether point j must run where it ran before."""
        sent: dict[int, int] = {}
        out: dict[tuple[int, int], Done] = {}
        for (j, k), w in zip(jobs, self.place(jobs, stays)):
            if w in self.dead:
                out[(j, k)] = Done(None, "its untimed worker ended early", ())
                continue
            try:
                self.workers[w][1].send((j, k))
                sent[w] = sent.get(w, 0) + 1
            except (OSError, EOFError):
                self.dead.add(w)
                out[(j, k)] = Done(None, "its untimed worker ended early", ())
        for w, expected in sent.items():
            for _ in range(expected):
                try:
                    j, k, done = self.workers[w][1].recv()
                except (EOFError, OSError):
                    self.dead.add(w)
                    break
                out[(j, k)] = done
        for j, k in jobs:
            out.setdefault((j, k), Done(None, "its untimed worker ended early", ()))
        return out

    def __exit__(self, *exc: Any) -> None:
        for process, connection in self.workers:
            try:
                connection.send(None)
            except (OSError, EOFError):
                pass
        for process, connection in self.workers:
            process.join(STOP_S)
            if process.is_alive():
                process.kill()
                process.join()
            connection.close()
        self.workers = []
