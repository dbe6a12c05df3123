"""A study in three phases: prepare, work, finish (one process runs all three by default).

    validate the whole config (one-line errors, nothing loaded yet)
    prepare: fingerprint the settings -> create the study (trial 0 = the method's default, once)
             or resume it (refused if its fingerprint differs) -> load models -> MLflow parent
    work:    until the search is done: take the next point nobody holds, build the method with
             every parameter (searched + fixed), time it against vanilla *in the same trial*
             (interleaved per prompt, order alternating), check losslessness (lossless methods)
             or score quality against vanilla (lossy ones: perplexity, task metric, the
             search's quality bound as Optuna constraints), tell Optuna, log
    finish:  best feasible trial -> held-out confirmation vs vanilla -> best YAML, summary,
             MLflow winner (no feasible trial: the summary says so and recommends vanilla)

A trial that raises (out-of-memory, a lossless violation, anything) is told FAIL with its error and
the study goes on. Ctrl-C / SIGTERM marks the running trial FAIL ("interrupted") and its MLflow runs
KILLED; re-running the same command resumes with nothing lost. Several processes may work on one
study at once: points held by RUNNING/WAITING trials are never planned twice.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import socket
import time
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Iterator

import optuna
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from optuna.trial import TrialState

from decoding.eagle_head import head_source
from decoding.models import resolve_device
from tuner.cluster import liveness
from tuner.tracking import report
from tuner.config.build import build_method, load_models
from tuner.measure.energy import EnergyMeter, EnergyReading
from tuner.config.errors import ConfigError, Interrupted
from tuner.config.identity import fingerprint, hardware, short_hash
from tuner.measure.measurement import (LosslessViolation, Measurement, Timer, check_against_vanilla,
                           geometric_mean, measure_prompt, paired_speedup, peak_memory_bytes,
                           reset_peak_memory, summarize, time_generation)
from tuner.search.objectives import ENERGY, PERPLEXITY, better_first, directions, objective_values
from tuner.measure.quality import QualityBound, compare, feasible, mean_log_prob
from tuner.search.plans import WAIT, GridPlan, HeuristicPlan, point_key
from tuner.search.space import grid_size, suggest
from tuner.study.storage import (RUN_TOKEN, fail_orphans, failure_reason, is_retried, journal_path,
                           make_storage, open_study)
from tuner.tasks.task import Task
from tuner.tracking.trackers import NullTracker, environment_tags, flatten, make_tracker
from tuner.config.validate import PHASES, check_head_fits, check_journal, plain, validate

VANILLA = {"_target_": "decoding.vanilla.Vanilla", "needs_draft": False}
# summary keys kept on every trial (the summary table and best_* metrics read them)
TRIAL_ATTRS = ("speedup", "tokens_per_s", "mean_accepted_tokens", "acceptance_rate",
               "vanilla_drift_ratio", "perplexity", "vanilla_perplexity", "perplexity_ratio",
               "quality_drop", "energy_j_per_token", "vanilla_energy_j_per_token", "energy_ratio")
POLL_S = 2.0          # how often a worker waiting for other workers' results looks again


def say(message: str) -> None:
    print(message, flush=True)


def resolve_budget(cfg: DictConfig, on_gpu: bool) -> dict[str, Any]:
    budget = {"n_prompts": int(cfg.task.n_prompts), "n_held_out": int(cfg.task.n_held_out),
              "max_new_tokens": int(cfg.task.max_new_tokens),
              "n_trials": int(cfg.search.n_trials)}
    if cfg.budget == "auto" and not on_gpu:
        capped = {k: min(v, int(cfg.cpu_budget[k])) for k, v in budget.items()}
        if capped != budget:
            say(f"No GPU: CPU-sized budget chosen automatically {capped} (the task asks for "
                f"{budget}); run with budget=full for the task's own settings.")
        budget = capped
    return budget


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (Slurm preemption, ``kill``) is handled like Ctrl-C: the state is saved first."""
    def handler(signum, frame):
        raise Interrupted(f"signal {signum}")
    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:                 # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class Study:
    """One tuning study; its state lives in the Optuna storage, this object wires things up."""

    def __init__(self, cfg: DictConfig, timer: Timer = time_generation,
                 open_storage: bool = True) -> None:
        # 1. validate everything cheap before anything expensive
        validate(cfg)
        self.cfg, self.timer = cfg, timer
        self.method_cfg = plain(cfg.method)
        self.space = self.method_cfg.get("space") or {}
        self.default = dict(self.method_cfg.get("params") or {})
        self.fixed = {k: v for k, v in self.default.items() if k not in self.space}
        self.task = Task(plain(cfg.task))
        self.device = resolve_device(plain(cfg.models)["target"].get("device"))
        self.budget = resolve_budget(cfg, self.device.type == "cuda")
        try:
            self.tuning, self.held_out = self.task.split(self.budget["n_prompts"],
                                                         self.budget["n_held_out"])
        except ValueError as err:
            raise ConfigError(str(err)) from None
        self.sampling = plain(cfg.sampling)
        self.greedy = float(self.sampling["temperature"]) == 0.0
        search = plain(cfg.search)
        self.objectives = list(search["objectives"])
        self.directions = directions(self.objectives)
        self.sign = better_first(self.directions[0])    # plans and the winner maximise sign·value
        self.lossless = bool(self.method_cfg.get("lossless", True))
        self.bound = QualityBound.from_search(search)
        # perplexity costs one target forward per output, after the timed window
        self.scores_perplexity = not self.lossless or bool(set(PERPLEXITY) &
                                                            set(self.objectives))
        self.meter = EnergyMeter(self.device)
        energy = [o for o in self.objectives if o in ENERGY]
        if energy and not self.meter.available:
            raise ConfigError(f"search.objectives={self.objectives} includes {energy[0]}, which "
                              f"needs GPU energy measurements, unavailable here: "
                              f"{self.meter.reason}")
        self.fingerprint = fingerprint(
            task=plain(cfg.task), tuning_ids=[p.id for p in self.tuning],
            held_out_ids=[p.id for p in self.held_out], budget=self.budget,
            sampling=self.sampling, seed=int(cfg.seed), models=plain(cfg.models),
            method={k: v for k, v in self.method_cfg.items()}, search=search,
            baseline=str(cfg.baseline), warmup_prompts=int(cfg.warmup_prompts),
            near_tie_ulps=float(cfg.near_tie_ulps), device=self.device)
        self.family = f"{cfg.study_prefix}-{short_hash(self.fingerprint)}"
        tag = cfg.get("study_tag")
        self.name = str(cfg.study_name or (f"{self.family}-{tag}" if tag else self.family))
        if not cfg.storage:
            check_journal(journal_path(cfg.studies_dir, self.name))
        self.plan = self._plan()
        if not open_storage:           # the Slurm launcher only needs the name and the checks
            return
        # 2. the study: created (trial 0 enqueued once) or resumed after the fingerprint check
        beat = plain(cfg.get("heartbeat")) or {}
        storage = make_storage(cfg.storage, journal_path(cfg.studies_dir, self.name),
                               int(beat.get("interval", 60)), beat.get("grace"))
        self.study, self.created = open_study(
            storage, self.name, self.directions,
            instantiate(search["sampler"]) if search.get("sampler") else None,
            instantiate(search["pruner"]) if search.get("pruner") else
            optuna.pruners.NopPruner(), self.fingerprint, self._searched(self.default),
            cfg.resume == "force", say, ignore=("hardware",) if cfg.phase == "work" and
            cfg.baseline == "per_trial" else ())
        # 3. tracking (the parent run is found again through the study)
        self.tracker = make_tracker(plain(cfg.tracking))
        self.parent_id = self.study.user_attrs.get("mlflow_parent_run_id")
        self.pair = None

    def load(self) -> None:
        """Models and tokenised prompts: only the phases that measure need them."""
        self.pair, self.tokenizer = load_models(self.cfg.models, self.method_cfg["needs_draft"])
        # method=eagle: the head loads and fits before any trial; every trial reuses it
        self.head = check_head_fits(self.method_cfg, self.pair.target)
        if self.head is not None:      # its weights were hashed once, for the fingerprint
            reference = self.method_cfg["params"]["head"]
            identity = json.loads(self.fingerprint["method.head"])
            say(f"EAGLE head {reference}: {head_source(reference, identity)}")
        self.ids = {p.id: self.task.encode(p, self.tokenizer) for p in self.tuning + self.held_out}
        self.vanilla = self._build(VANILLA, {})
        self._log_probs: dict[tuple, float] = {}       # (prompt id, tokens) -> mean log p
        self._vanilla_quality: dict[tuple, dict] = {}  # vanilla's outputs repeat (fixed seed)

    # -- building and measuring -------------------------------------------------------------

    def _searched(self, params: dict) -> dict:
        return {k: v for k, v in params.items() if k in self.space}

    def _build(self, method_cfg: dict, params: dict) -> Any:
        if getattr(self, "head", None) is not None and "head" in params:
            params = {**params, "head": self.head}      # loaded once in load(), same reference
        return build_method(method_cfg, params, self.pair, self.sampling, int(self.cfg.seed))

    def _measure(self, method: Any, prompt: Any) -> Measurement:
        with self.meter:
            m = measure_prompt(method, prompt, self.ids[prompt.id], self.budget["max_new_tokens"],
                               self.tokenizer, self.device, self.timer)
        reading = self.meter.reading
        return replace(m, energy_j=reading.joules if reading and reading.available else None)

    def _warmup(self, *methods: Any) -> None:
        for method in methods:
            for prompt in self.tuning[: int(self.cfg.warmup_prompts)]:
                measure_prompt(method, prompt, self.ids[prompt.id],
                               self.budget["max_new_tokens"], self.tokenizer, self.device,
                               self.timer)
            if hasattr(method, "reset"):     # warm-up must not seed the measured phrase pool
                method.reset()

    def _check(self, m: Measurement, reference: list[int], prompt_id: str) -> Measurement:
        if self.greedy and self.lossless:
            return check_against_vanilla(m, reference, self.ids[prompt_id], self.pair.target,
                                         float(self.cfg.near_tie_ulps))
        return m

    def study_baseline(self) -> dict[str, dict]:
        """``baseline=per_study``: vanilla once per study (stored with the study's fingerprint)."""
        stored = self.study.user_attrs.get("baseline")
        if stored and set(stored) >= {p.id for p in self.tuning}:
            return stored
        say("baseline (per_study): measuring vanilla once on the tuning prompts ...")
        self._warmup(self.vanilla)
        ms = [self._measure(self.vanilla, p) for p in self.tuning]
        baseline = {m.prompt_id: {"tokens": list(m.tokens), "wall_s": m.wall_s,
                                  "energy_j": m.energy_j} for m in ms}
        self.study.set_user_attr("baseline", baseline)
        self._log_baseline(ms)
        return baseline

    def evaluate(self, trial: optuna.Trial, params: dict) -> tuple[dict, list, list]:
        """Time the method against vanilla on every tuning prompt (paired, interleaved A/B)."""
        method = self._build(self.method_cfg, params)
        per_trial = self.cfg.baseline == "per_trial"
        stored = None if per_trial else self.study_baseline()
        self._warmup(*([self.vanilla, method] if per_trial else [method]))
        reset_peak_memory(self.device)
        order = list(enumerate(self.tuning))
        random.Random(f"{self.cfg.seed}-{trial.number}").shuffle(order)
        ms: list[Measurement] = []
        refs: list[Measurement] = []
        for done, (index, prompt) in enumerate(order, 1):
            if per_trial:
                vanilla_first = (trial.number + done) % 2 == 0     # alternate A/B and B/A
                ref = self._measure(self.vanilla, prompt) if vanilla_first else None
                got = self._measure(method, prompt)
                ref = ref or self._measure(self.vanilla, prompt)
                refs.append(ref)
                reference = list(ref.tokens)
                speedup = paired_speedup(ref, got)
            else:
                base = stored[prompt.id]
                reference = base["tokens"]
                got = self._measure(method, prompt)
                speedup = (base["wall_s"] / max(len(reference), 1)) / got.s_per_token
            got = self._check(replace(got, speedup=speedup), reference, prompt.id)
            ms.append(got)
            say(f"  trial {trial.number} prompt {done}/{len(order)}: {got.new_tokens} tokens "
                f"{got.tokens_per_s:.2f} tok/s, paired speedup {got.speedup:.3f}")
            if self.objectives == ["speedup"]:        # the pruner is fed paired speedups
                trial.report(got.speedup, step=index)
                if done < len(order) and trial.should_prune():
                    trial.set_user_attr("pruned_at", done)
                    say(f"  trial {trial.number} pruned after {done} prompts")
                    break
        summary = summarize(ms, _energy(ms, self.meter), self.device)
        if refs:
            summary.update(self._drift(refs))
        prompts = [p for _, p in order][: len(ms)]
        vanilla = refs or [self._stored_vanilla(p, stored[p.id]) for p in prompts]
        summary.update(_energy_versus(summary, vanilla))
        record, ms, refs = self._quality(prompts, ms, vanilla, refs)
        summary.update(record)
        return summary, ms, refs

    def _stored_vanilla(self, prompt: Any, stored: dict) -> Measurement:
        """``baseline=per_study``: the study's vanilla output for ``prompt`` as a Measurement."""
        text = self.tokenizer.decode(stored["tokens"], skip_special_tokens=True)
        return Measurement(prompt.id, prompt.category, tuple(stored["tokens"]), text,
                           stored["wall_s"], 0, 0, 0, 0.0, 0.0, (), (),
                           energy_j=stored.get("energy_j"))

    def _quality(self, prompts: list, ms: list[Measurement], vanilla: list[Measurement],
                 refs: list[Measurement]) -> tuple[dict[str, float], list, list]:
        """Task quality of the method and of vanilla on the same prompts; perplexities (lossy
        methods, perplexity objectives). Runs after the timed window; fills ``mean_log_prob``."""
        method_quality, _ = self.task.score(prompts, [m.text for m in ms])
        key = tuple((p.id, v.tokens) for p, v in zip(prompts, vanilla))
        if key not in self._vanilla_quality:
            self._vanilla_quality[key] = self.task.score(prompts, [v.text for v in vanilla])[0]
        method_lp = vanilla_lp = None
        if self.scores_perplexity:
            ms = [replace(m, mean_log_prob=self._log_prob(p.id, m.tokens))
                  for p, m in zip(prompts, ms)]
            vanilla = [replace(v, mean_log_prob=self._log_prob(p.id, v.tokens))
                       for p, v in zip(prompts, vanilla)]
            refs = vanilla if refs else refs
            method_lp = [m.mean_log_prob for m in ms]
            vanilla_lp = [v.mean_log_prob for v in vanilla]
        record = compare(method_quality, self._vanilla_quality[key], method_lp, vanilla_lp)
        return record, ms, refs

    def _log_prob(self, prompt_id: str, tokens: tuple[int, ...]) -> float:
        key = (prompt_id, tuple(tokens))
        if key not in self._log_probs:
            self._log_probs[key] = mean_log_prob(self.pair.target, self.ids[prompt_id], tokens)
        return self._log_probs[key]

    def _drift(self, refs: list[Measurement]) -> dict[str, float]:
        """This trial's vanilla speed against the study's first on this hardware."""
        s_per_token = sum(r.wall_s for r in refs) / max(sum(r.new_tokens for r in refs), 1)
        key = f"vanilla_reference_{short_hash({'hw': hardware(self.device)})}"
        reference = self.study.user_attrs.get(key)
        if reference is None:
            self.study.set_user_attr(key, s_per_token)
            reference = s_per_token
        ratio = s_per_token / reference
        return {"vanilla_tokens_per_s": 1.0 / s_per_token, "vanilla_drift_ratio": ratio}

    # -- planning ------------------------------------------------------------------------------

    def _plan(self):
        kind = self.cfg.search.kind
        task_class = self.task.task_class
        if kind == "heuristic":
            return HeuristicPlan(self.space, task_class, int(self.cfg.seed),
                                 self._searched(self.default))
        if kind == "grid":
            ranges = self.cfg.search.get("ranges", "heuristic")
            plan = GridPlan(self.space, self._searched(self.default), ranges, task_class)
            if plan.size() > self.budget["n_trials"]:
                say(f"WARNING: search.n_trials={self.budget['n_trials']} truncates the "
                    f"{ranges} grid of {plan.size()} points: {plan.size() - self.budget['n_trials']}"
                    " points will not be evaluated (raise search.n_trials, or budget=full)")
            return plan
        return None

    def _limit(self) -> int:
        if self.plan is None:
            return self.budget["n_trials"]
        return min(self.budget["n_trials"], self.plan.size() + 1)

    def _counts(self, trial, dead: set[int] | None = None) -> bool:
        """Trials that used budget: finished ones, except failures that say nothing of their point."""
        if dead is None:
            dead = liveness.orphans(self.study)
        return trial.state in (TrialState.COMPLETE, TrialState.PRUNED) or \
            (trial.state == TrialState.FAIL and not is_retried(self.study, trial, dead))

    def spent(self) -> int:
        dead = liveness.orphans(self.study)
        return sum(self._counts(t, dead) for t in self.study.get_trials(deepcopy=False))

    def _points(self) -> tuple[dict[tuple, float], set[tuple]]:
        results, taken = {}, set()
        dead = liveness.orphans(self.study)
        for t in self.study.get_trials(deepcopy=False):
            if t.state == TrialState.COMPLETE and "pruned_at" not in t.user_attrs:
                # an infeasible point is never best (like a failed one)
                results[point_key(t.params)] = self.sign * t.values[0] if \
                    t.user_attrs.get("feasible", True) else -math.inf
            elif t.state == TrialState.FAIL and self._counts(t, dead):
                results[point_key(t.params)] = -math.inf
            elif t.state == TrialState.RUNNING:
                taken.add(point_key(t.params))
            elif t.state == TrialState.WAITING:    # enqueued by a plan, or a dead trial's retry
                point = t.user_attrs.get("point")
                taken.add(point_key(json.loads(point)) if point else point_key(t.params))
        return results, taken

    def next_trial(self) -> optuna.Trial | str | None:
        """Ask for the next trial: a queued point first, else the plan's next free point."""
        states = (TrialState.WAITING,)
        if not self.study.get_trials(deepcopy=False, states=states) and self.plan is not None:
            step = self.plan.next_point(*self._points())
            if step is None or step == WAIT:
                return step
            point, stage = step
            self.study.enqueue_trial(point, user_attrs={"stage": stage,
                                                        "point": json.dumps(point)})
        trial = self.study.ask()
        if self.plan is not None and "stage" not in trial.user_attrs:   # lost a race for it
            self._tell_fail(trial, "duplicate: another worker took the queued point", None)
            return "retry"
        return trial

    def _claim(self, trial: optuna.Trial, values: dict) -> bool:
        """Another worker already holds or evaluated this point: fail ours as a duplicate."""
        key = point_key(values)
        for other in self.study.get_trials(deepcopy=False):
            if other.number < trial.number and point_key(other.params) == key and \
                    (other.state in (TrialState.RUNNING, TrialState.COMPLETE, TrialState.PRUNED)
                     or (other.state == TrialState.FAIL and self._counts(other))):
                self._tell_fail(trial, f"duplicate: trial {other.number} has this point", None)
                return False
        return True

    # -- the work loop ------------------------------------------------------------------------

    def _tell_fail(self, trial: optuna.Trial, message: str, run_id: str | None,
                   status: str = "FAILED", kind: str = "error") -> None:
        trial.set_user_attr("error", message)
        trial.set_user_attr("error_kind", kind)
        self.study.tell(trial, state=TrialState.FAIL)
        self.tracker.end_run(run_id, {}, {"state": "FAIL", "error": message[:500]}, status)

    def work(self) -> None:
        """Run trials until the plan is done, the trial budget is spent or the timeout passes.

        With other workers on the study, a worker that finds the remaining points held by them
        waits (polling) instead of leaving: if one of them dies, its point comes back here.
        """
        began, timeout = time.monotonic(), self.cfg.search.get("timeout")
        while True:
            self.reap()
            running = len(self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)))
            spent = self.spent()
            if spent >= self._limit():
                break
            if timeout and time.monotonic() - began > float(timeout):
                say(f"search.timeout={timeout}s reached: no new trials")
                break
            if spent + running >= self._limit():
                time.sleep(POLL_S)         # the rest is held by other workers
                continue
            trial = self.next_trial()
            if trial is None and not running:
                break
            if trial in (None, WAIT, "retry"):
                if trial != "retry":
                    time.sleep(POLL_S)     # other workers hold points this plan depends on
                continue
            # beat from the moment the trial exists: a worker that dies before its first
            # heartbeat would leave a trial that never looks stale
            with liveness.Heartbeat.for_trial(self.study, trial):
                self.run_trial(trial)

    def reap(self) -> None:
        """Fail the trials of dead workers (same host: pid; Slurm: job id; RDB: heartbeat)."""
        fail_orphans(self.study, say)
        for number in liveness.reap(self.study):
            say(f"trial {number}: its worker is gone (Slurm job ended or heartbeat stale); "
                "marked FAIL, its point is queued again")

    def run_trial(self, trial: optuna.Trial) -> None:
        values = suggest(trial, self.space, conditional=self.plan is None)
        if self.plan is not None and not self._claim(trial, values):
            return
        params = {**self.default, **values}          # every parameter: searched + fixed
        stage = trial.user_attrs.get("stage", self.cfg.search.kind)
        for key, value in {"host": socket.gethostname(), "pid": os.getpid(),
                           "run_token": RUN_TOKEN, "params": json.dumps(params),
                           "sampling": json.dumps(self.sampling),
                           "hardware": hardware(self.device),
                           "slurm_job_id": _slurm_job_id()}.items():
            if value is not None:
                trial.set_user_attr(key, value)
        say(f"trial {trial.number} [{stage}] {params}")
        run_id = self.tracker.start_run(f"trial-{trial.number}",
                                        {**params, **flatten("sampling", self.sampling)},
                                        {"kind": "trial", "stage": stage,
                                         "trial": str(trial.number)})
        if run_id:
            trial.set_user_attr("mlflow_run_id", run_id)
        try:
            summary, ms, refs = self.evaluate(trial, params)
            values_out = objective_values(summary, self.objectives)
        except KeyboardInterrupt:
            self._tell_fail(trial, "interrupted: the study was stopped during this trial",
                            run_id, "KILLED")
            raise
        except (ValueError, TypeError) as err:     # the method refused its parameters
            self._report_failure(trial, err, run_id, "config")
            return
        except (Exception, torch.OutOfMemoryError) as err:   # noqa: BLE001 - never kill it
            self._report_failure(trial, err, run_id, "error")
            return
        constraints = self.bound.constraints(summary, self.lossless)
        for key, value in constraints.items():       # Optuna 5: read by TPE, NSGA-II, GP
            trial.set_constraint(key, value)
        if constraints:
            summary["feasible"] = float(feasible(constraints))
            trial.set_user_attr("feasible", feasible(constraints))
            trial.set_user_attr("constraints", constraints)
        for key in TRIAL_ATTRS:
            if key in summary:
                trial.set_user_attr(key, summary[key])
        drifted = abs(summary.get("vanilla_drift_ratio", 1.0) - 1) > float(
            self.cfg.drift_threshold)
        if drifted:
            trial.set_user_attr("vanilla_drift", True)
            say(f"  WARNING: trial {trial.number}: vanilla ran at "
                f"{summary['vanilla_drift_ratio']:.2f}x the study's first vanilla time per "
                f"token (threshold {self.cfg.drift_threshold}): the machine's speed changed; "
                "the paired speedup still compares like with like")
        self.study.tell(trial, values_out)
        table = [asdict(m) for m in ms] + [{"vanilla": True, **asdict(r)} for r in refs]
        tags = {"state": "COMPLETE", "vanilla_drift": str(drifted).lower(),
                "energy": self.meter.reason or "nvml"}
        if constraints:
            tags["feasible"] = str(feasible(constraints)).lower()
        self.tracker.end_run(run_id, summary, tags, "FINISHED", table)
        if refs and "mlflow_baseline_run_id" not in self.study.user_attrs:
            self._log_baseline(refs)
        quality = ""
        if "perplexity_ratio" in summary:
            quality = f", perplexity ratio {summary['perplexity_ratio']:.3f}"
        if "quality_drop" in summary and not self.lossless:
            quality += f", quality drop {summary['quality_drop']:+.3f}"
        if constraints:
            quality += ", feasible" if feasible(constraints) else \
                f", INFEASIBLE ({self.bound.describe()})"
        say(f"trial {trial.number} done: paired speedup {summary['speedup']:.3f} "
            f"({summary['tokens_per_s']:.2f} tok/s, mean accepted "
            f"{summary['mean_accepted_tokens']:.2f}{quality})")

    def _log_baseline(self, refs: list[Measurement]) -> None:
        """One 'baseline (vanilla)' run per study, speedup 1.0: the reference row in MLflow."""
        summary = summarize([replace(r, speedup=1.0) for r in refs], _energy(refs, self.meter),
                            self.device)
        run_id = self.tracker.start_run("baseline (vanilla)", {"method": "vanilla"},
                                        {"kind": "baseline"})
        self.tracker.end_run(run_id, summary, {"state": "COMPLETE"}, "FINISHED",
                             [asdict(r) for r in refs])
        self.study.set_user_attr("mlflow_baseline_run_id", run_id or "none")

    def _report_failure(self, trial, err: BaseException, run_id, kind: str) -> None:
        message = f"{type(err).__name__}: {err}"
        self._tell_fail(trial, message, run_id, kind=kind)
        say(f"trial {trial.number} FAILED: {message}")
        if isinstance(err, LosslessViolation):
            say("  (a lossless method diverged from vanilla: this is a bug, not a bad "
                "hyperparameter)")

    # -- finish -------------------------------------------------------------------------------

    def completed(self) -> list:
        return [t for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                if "pruned_at" not in t.user_attrs]

    def best(self) -> tuple[dict, dict] | None:
        """The best feasible completed trial (by the first objective; Pareto front first)."""
        done = [t for t in self.completed() if t.user_attrs.get("feasible", True)]
        if not done:
            return None
        if len(self.directions) > 1:   # Study.best_trials honours the constraints too
            front = [t for t in self.study.best_trials if t.user_attrs.get("feasible", True)
                     and "pruned_at" not in t.user_attrs]
            done = front or done
        best = max(done, key=lambda t: self.sign * t.values[0])
        params = json.loads(best.user_attrs.get("params", "null")) or \
            {**self.default, **best.params}
        return params, {"trial": best.number, "value": best.values[0],
                        "trials": len(self.completed()),
                        "run_id": best.user_attrs.get("mlflow_run_id"),
                        "summary": dict(best.user_attrs)}

    def confirm(self, params: dict) -> dict[str, float]:
        """The configuration vs vanilla on held-out prompts the search never saw (interleaved)."""
        if not self.held_out:
            return {}
        say(f"held-out confirmation on {len(self.held_out)} prompts: vanilla vs {params}")
        best = self._build(self.method_cfg, params)
        self._warmup(self.vanilla, best)
        pairs = []
        for i, p in enumerate(self.held_out):   # interleaved, order alternating
            first = self._measure(self.vanilla if i % 2 == 0 else best, p)
            second = self._measure(best if i % 2 == 0 else self.vanilla, p)
            ref, got = (first, second) if i % 2 == 0 else (second, first)
            got = self._check(replace(got, speedup=paired_speedup(ref, got)), list(ref.tokens),
                              p.id)
            pairs.append((ref, got))
        speedups = [g.speedup for _, g in pairs]
        out = {"held_out_speedup": geometric_mean(speedups), "held_out_speedup_min":
               min(speedups), "held_out_speedup_max": max(speedups),
               "held_out_tokens_per_s": sum(g.new_tokens for _, g in pairs) /
               sum(g.wall_s for _, g in pairs),
               "held_out_vanilla_tokens_per_s": sum(r.new_tokens for r, _ in pairs) /
               sum(r.wall_s for r, _ in pairs),
               "held_out_mean_accepted_tokens": 1 + sum(g.accepted for _, g in pairs) /
               sum(g.steps for _, g in pairs)}
        checks = [g.matches_vanilla for _, g in pairs if g.matches_vanilla is not None]
        if checks:
            out["held_out_matches_vanilla"] = sum(checks) / len(checks)
        record, _, _ = self._quality(self.held_out, [g for _, g in pairs],
                                     [r for r, _ in pairs], [])
        out.update({f"held_out_{k}": v for k, v in record.items()})
        if self.bound.active:
            out["held_out_feasible"] = float(feasible(self.bound.constraints(record,
                                                                              self.lossless)))
        out["held_out_truncated_fraction"] = sum(g.truncated for _, g in pairs) / len(pairs)
        return out

    def notes(self, confirmed: dict, summary: dict) -> list[str]:
        out = []
        truncated = confirmed.get("held_out_truncated_fraction",
                                  summary.get("truncated_fraction", 0.0)) or 0.0
        if self.task.metric.__name__ != "_speed_only" and truncated >= 0.5:
            out.append(f"quality is not meaningful: {truncated:.0%} of the outputs were cut at "
                       f"max_new_tokens={self.budget['max_new_tokens']} before an answer "
                       "(raise task.max_new_tokens, or budget=full)")
        if self.device.type == "cpu":
            out.append("CPU run: a wide verification forward costs several single-token "
                       "forwards here; speedups on a GPU differ")
        failed = [t for t in self.study.get_trials(deepcopy=False, states=(TrialState.FAIL,))
                  if self._counts(t)]
        if failed:
            out.append(f"{len(failed)} trial(s) failed; first: "
                       f"{failure_reason(self.study, failed[0])[:120]}")
        drifted = [t.number for t in self.study.get_trials(deepcopy=False)
                   if t.user_attrs.get("vanilla_drift")]
        if drifted:
            out.append(f"vanilla speed drifted beyond drift_threshold in trials {drifted}")
        if not self.lossless and not self.greedy:
            out.append("lossy method at temperature > 0: quality is compared with one sampled "
                       "vanilla output per prompt; with few prompts the perplexity ratio and "
                       "the quality drop are noisy")
        if self.bound.active:
            broken = [t.number for t in self.completed() if t.user_attrs.get("feasible") is False]
            out.append(f"quality bound {self.bound.describe()}: {len(broken)} of "
                       f"{len(self.completed())} trials broke it"
                       f"{f' (trials {broken})' if broken else ''}; they are never chosen")
        return out

    def no_feasible_trial(self) -> dict[str, Any]:
        """Every completed trial broke the quality bound: say so, recommend vanilla, no winner."""
        done = self.completed()
        fastest = max(done, key=lambda t: self.sign * t.values[0])
        rows = [("study", self.name), ("quality bound", self.bound.describe()),
                ("feasible trials", f"0 of {len(done)}"),
                ("best infeasible trial", f"#{fastest.number}: {fastest.params}, "
                 f"{self.objectives[0]} {fastest.values[0]:.3f}, constraint values "
                 f"{fastest.user_attrs.get('constraints')}")]
        rows += [("note", note) for note in self.notes({}, dict(fastest.user_attrs))]
        advice = (f"use vanilla decoding: no configuration met the quality bound "
                  f"({self.bound.describe()}); relax search.max_quality_drop / "
                  "search.max_perplexity_ratio only if that quality loss is acceptable")
        self.tracker.finish_study({"feasible_trials": 0.0, "infeasible_trials": float(len(done))},
                                  {"best_trial": "none", "best_feasible": "none"},
                                  report.markdown(rows, advice), [])
        report.print_summary(rows, advice, say)
        return {"study_name": self.name, "feasible": False, "trials": len(done)}

    def finish(self) -> dict[str, Any]:
        found = self.best()
        if found is None and self.completed():
            return self.no_feasible_trial()
        if found is None:
            failed = [t for t in self.study.trials if t.state == TrialState.FAIL]
            reason = failure_reason(self.study, failed[-1]) if failed else "none ran"
            raise RuntimeError(f"no trial completed in study {self.name} ({len(failed)} failed; "
                               f"last: {reason[:300]}); fix the cause and re-run the same command "
                               "to resume")
        params, best = found
        confirmed = self.confirm(params)
        summary = best.pop("summary")
        choice = OmegaConf.select(self.cfg, "hydra.runtime.choices.method", default=None) or \
            self.method_cfg["_target_"].split(".")[-1].lower()
        path = report.write_best_yaml(Path(self.cfg.studies_dir) / "best", self.name,
                                      self.task.name, choice, plain(self.cfg.models),
                                      self.sampling, int(self.cfg.seed), params, best, confirmed)
        notes = self.notes(confirmed, summary)
        since = report.compare_previous(Path(self.cfg.studies_dir) / "best", self.family,
                                        self.name, params, confirmed)
        if since:
            notes.insert(0, since)
        rows = report.summary_rows(self.name, params, best, confirmed, summary, self.budget,
                                   notes, self.meter.reason, self.bound.describe()
                                   if self.bound.active or not self.lossless else None)
        advice = report.recommendation(confirmed)
        files = [("best", path)]
        for plot in (report.plots_png(self.study, Path(path).with_suffix(".history.png")),
                     report.plots_html(self.study, Path(path).with_suffix(".plots.html"))):
            if plot:
                files.append(("plots", plot))
        self.tracker.mark_winner(best.get("run_id"), best["trial"])
        numeric = {k: v for k, v in summary.items() if k in TRIAL_ATTRS}
        tags = {"best_params": json.dumps(params), "best_trial": str(best["trial"])}
        metrics = {**{f"best_{k}": v for k, v in numeric.items()},
                   **{f"best_{k}": v for k, v in confirmed.items()}}
        if self.bound.active:
            tags["best_feasible"] = "true"
            metrics["infeasible_trials"] = float(sum(t.user_attrs.get("feasible") is False
                                                     for t in self.completed()))
        self.tracker.finish_study(metrics, tags, report.markdown(rows, advice), files)
        report.print_summary(rows, advice, say)
        say(f"best configuration written to {path}")
        return {"params": params, "study_name": self.name, **best, **confirmed}

    # -- tracking set-up ----------------------------------------------------------------------

    def start_tracking(self) -> None:
        params = {"task": self.task.name, "method": self.method_cfg["_target_"],
                  "search": self.cfg.search.kind, "baseline": self.cfg.baseline,
                  "fingerprint": short_hash(self.fingerprint),
                  **flatten("budget", self.budget), **flatten("sampling", self.sampling),
                  **flatten("models", plain(self.cfg.models)),
                  **flatten("params", self.default), "lossless": self.lossless,
                  "search.objectives": json.dumps(self.objectives),
                  **flatten("search", {k: plain(self.cfg.search).get(k) for k in
                                       ("max_quality_drop", "max_perplexity_ratio")})}
        tags = {"study_name": self.name, "kind": "study", "hardware": hardware(self.device),
                "energy": self.meter.reason or "nvml", **environment_tags(self.device)}
        config = OmegaConf.to_yaml(OmegaConf.masked_copy(
            self.cfg, [k for k in self.cfg if k != "hydra"]), resolve=True)
        deadline = time.monotonic() + 30
        while self.parent_id is None and not self.created and time.monotonic() < deadline and \
                not isinstance(self.tracker, NullTracker):
            time.sleep(0.5)                # the study's creator is about to record its parent run
            self.parent_id = self.study.user_attrs.get("mlflow_parent_run_id")
        parent = self.tracker.start_study(self.name, self.parent_id, params, tags, config)
        if parent and parent != self.parent_id:
            self.study.set_user_attr("mlflow_parent_run_id", parent)
            self.parent_id = parent

    def describe(self) -> None:
        say(f"study {self.name} ({'new' if self.created else 'resumed'}): task {self.task.name} "
            f"({self.task.task_class}), method {self.method_cfg['_target_']}, "
            f"{len(self.tuning)} tuning + {len(self.held_out)} held-out prompts, "
            f"{self.budget['max_new_tokens']} new tokens, device {self.device} "
            f"({hardware(self.device)}), search {self.cfg.search.kind}, baseline "
            f"{self.cfg.baseline}, grid size {grid_size(self.space)}")


def _energy(ms: list[Measurement], meter: EnergyMeter) -> EnergyReading:
    joules = [m.energy_j for m in ms]
    if not meter.available or any(j is None for j in joules):
        return EnergyReading(False, meter.reason or "unavailable", None, 0.0)
    seconds = sum(m.wall_s for m in ms)
    return EnergyReading(True, "nvml_total_energy", float(sum(joules)), seconds)


def _energy_versus(summary: dict, vanilla: list[Measurement]) -> dict[str, float]:
    """Vanilla's J/token on the same prompts and the method's ratio to it (NVML, GPU only)."""
    joules = [v.energy_j for v in vanilla]
    if "energy_j_per_token" not in summary or not vanilla or any(j is None for j in joules):
        return {}
    per_token = sum(joules) / max(sum(v.new_tokens for v in vanilla), 1)
    return {"vanilla_energy_j_per_token": per_token,
            "energy_ratio": summary["energy_j_per_token"] / per_token}


def _slurm_job_id() -> str | None:
    job, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if job and task:
        return f"{job}_{task}"
    return os.environ.get("SLURM_JOB_ID")


def replay(cfg: DictConfig, timer: Timer = time_generation) -> dict[str, Any]:
    """``+best=<study>``: a fresh paired measurement of exactly that configuration vs vanilla."""
    s = Study(cfg, timer, open_storage=False)       # validated; no study storage is touched
    if not s.held_out:
        raise ConfigError("replay (+best=...) measures on held-out prompts: task.n_held_out=0 "
                          "leaves none; allowed is an integer >= 1")
    s.load()
    origin = plain(cfg.replay)
    recorded = origin.get("held_out_speedup")
    recorded = f"{recorded:.3f}x" if isinstance(recorded, (int, float)) else "none"
    say(f"replay of study {origin['study']} trial {origin['trial']} (recorded held-out speedup "
        f"{recorded}): {s.default}")
    confirmed = s.confirm(s.default)
    tracker = make_tracker(plain(cfg.tracking))
    tracker.start_study(f"replay-{origin['study']}", None,
                        {"replay_of": origin["study"], "trial": origin["trial"],
                         **flatten("params", s.default), **flatten("budget", s.budget)},
                        {"kind": "replay", **environment_tags(s.device)}, OmegaConf.to_yaml(
                            OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]),
                            resolve=True))
    tracker.finish_study(confirmed, {}, f"Replay of {origin['study']} trial {origin['trial']}: "
                         f"held-out speedup {confirmed['held_out_speedup']:.3f}x", [])
    say(f"replay: held-out speedup {confirmed['held_out_speedup']:.3f}x (min "
        f"{confirmed['held_out_speedup_min']:.3f}, max {confirmed['held_out_speedup_max']:.3f});"
        f" recorded {recorded}")
    if not s.lossless:
        held = report.held_out(confirmed)
        say(f"replay: held-out quality vs vanilla: {report.quality_line(held)}")
    return {"params": s.default, **confirmed}


def run(cfg: DictConfig, timer: Timer = time_generation) -> dict[str, Any]:
    """Run (or resume) the study described by ``cfg``; returns the final summary.

    ``phase``: all (default: prepare, work, finish in this process), prepare (create the study,
    trial 0 and the MLflow parent; no models), work (a worker: trials until the search is done),
    finish (best, held-out confirmation, YAML, summary). Any number of workers may run at once.
    """
    optuna.logging.set_verbosity(optuna.logging.WARNING)   # our own lines say what happens
    if cfg.get("replay"):
        return replay(cfg, timer)
    phase = cfg.get("phase", "all")
    if phase not in PHASES:
        raise ConfigError(f"phase={phase!r} is invalid: allowed are {list(PHASES)}")
    if (cfg.get("launcher") or {}).get("kind") == "slurm" and phase == "all":
        from tuner.cluster.launch import launch   # noqa: PLC0415 - only for Slurm
        planned = Study(cfg, timer, open_storage=False)     # validated and named; nothing loaded
        return launch(cfg, planned.name, say)
    s = Study(cfg, timer)
    s.describe()
    with sigterm_as_interrupt():
        try:
            s.start_tracking()
            if phase == "prepare":
                say(f"prepared study {s.name}: {len(s.study.trials)} trial(s) recorded")
                return {"study_name": s.name, "created": s.created}
            s.load()
            if phase in ("all", "work"):
                s.work()
            if phase == "work":
                say(f"worker done: {s.spent()} trial(s) spent in study {s.name}")
                return {"study_name": s.name}
            return s.finish()
        except KeyboardInterrupt as err:
            s.tracker.end_study("KILLED")
            raise Interrupted(f"study {s.name} interrupted; its trials are saved") from err
        except BaseException:
            s.tracker.end_study("FAILED")
            raise
