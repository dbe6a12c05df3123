"""The study: baseline once, trials (ask/tell) until the search is done, held-out confirmation.

    configs -> task prompts + models -> baseline (vanilla, stored in the study) -> for each trial:
    build the method, time it per prompt (paired with the baseline), check losslessness, tell
    Optuna, log MLflow -> best on held-out prompts vs vanilla -> summary + best-config YAML.

A trial that raises (out-of-memory, a lossless violation, anything) is told FAIL with its error and
the study goes on. Re-running the same command resumes: finished trials are kept, and trials left
RUNNING by a dead process on this host are marked FAIL and their points evaluated again.
"""

from __future__ import annotations

import math
import os
import random
import socket
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import optuna
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from optuna.trial import TrialState

from tuner.build import build_method, load_models, plain
from tuner.energy import EnergyMeter
from tuner.measure import (LosslessViolation, Measurement, check_against_vanilla,
                           geometric_mean, measure_prompt, summarize)
from tuner.search import GridPlan, HeuristicPlan, point_key
from tuner.space import distributions, grid_size, validate_params
from tuner.tasks.task import Task
from tuner.track import make_tracker

TASKS_DIR = Path(__file__).resolve().parents[1] / "conf" / "task"


def say(message: str) -> None:
    print(message, flush=True)


def resolve_budget(cfg: DictConfig, on_gpu: bool) -> dict[str, Any]:
    budget = {"n_prompts": int(cfg.task.n_prompts), "n_held_out": int(cfg.task.n_held_out),
              "max_new_tokens": int(cfg.task.max_new_tokens),
              "n_trials": int(cfg.search.n_trials)}
    if cfg.budget not in ("auto", "full"):
        raise ValueError(f"budget={cfg.budget!r} is invalid: allowed are auto, full")
    if cfg.budget == "auto" and not on_gpu:
        capped = {k: min(v, int(cfg.cpu_budget[k])) for k, v in budget.items()}
        if capped != budget:
            say(f"No GPU: CPU-sized budget chosen automatically {capped} (the task asks for "
                f"{budget}); run with budget=full for the task's own settings.")
        budget = capped
    return budget


def make_storage(cfg: DictConfig) -> Any:
    if cfg.get("storage"):
        return str(cfg.storage)
    folder = Path(cfg.studies_dir).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    # An absolute path matters: Optuna's symlink lock points at the path as given, and a relative
    # target makes the link dangle, so a lock left by a killed process is never detected as stale
    # (the next run would spin forever); with an absolute path it is released after 30 s.
    backend = optuna.storages.journal.JournalFileBackend(str(folder / f"{cfg.study_name}.journal"))
    return optuna.storages.JournalStorage(backend)


def fail_orphans(study: optuna.Study) -> None:
    """Mark FAIL the RUNNING trials whose process on this host is gone (a killed earlier run)."""
    host = socket.gethostname()
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        attrs = trial.user_attrs
        if attrs.get("host") != host or _alive(int(attrs.get("pid", -1))):
            continue
        study._storage.set_trial_user_attr(trial._trial_id, "error",
                                           "orphaned: its process ended before it finished")
        study._storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
        say(f"resume: trial {trial.number} was left RUNNING by process {attrs.get('pid')}; "
            "marked FAIL, its point will be evaluated again")


def _orphaned(trial: optuna.trial.FrozenTrial) -> bool:
    """Failed only because its process died (by ``fail_orphans``): its point is retried."""
    return str(trial.user_attrs.get("error", "")).startswith("orphaned")


def _alive(pid: int) -> bool:
    if pid <= 0 or pid == os.getpid():
        return pid == os.getpid()
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Study:
    """One tuning run; state lives in the Optuna study, this object only wires things together."""

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.method_cfg = plain(cfg.method)
        self.space = self.method_cfg.get("space") or {}
        self.default = dict(self.method_cfg.get("params") or {})
        validate_params(self.default, self.space)
        distributions(self.space)                                  # bad ranges fail early
        self.task = Task(plain(cfg.task))
        self.pair, self.tokenizer = load_models(cfg.models, self.method_cfg.get("needs_draft"))
        self.device = self.pair.device
        self.budget = resolve_budget(cfg, self.device.type == "cuda")
        self.tuning, self.held_out = self.task.split(self.budget["n_prompts"],
                                                     self.budget["n_held_out"])
        self.ids = {p.id: self.task.encode(p, self.tokenizer) for p in self.tuning + self.held_out}
        self.sampling = plain(cfg.sampling)
        self.greedy = float(self.sampling["temperature"]) == 0.0
        self.directions = list(cfg.search.directions)
        self.study = optuna.create_study(
            study_name=cfg.study_name, storage=make_storage(cfg), directions=self.directions,
            sampler=instantiate(cfg.search.sampler) if cfg.search.get("sampler") else None,
            pruner=instantiate(cfg.search.pruner) if cfg.search.get("pruner") else
            optuna.pruners.NopPruner(), load_if_exists=True)
        self.tracker = make_tracker(plain(cfg.tracking))

    # -- measurements ----------------------------------------------------------------------

    def _method(self, name_cfg: dict, params: dict) -> Any:
        return build_method(name_cfg, params, self.pair, self.sampling, int(self.cfg.seed))

    def _warmup(self, method: Any) -> None:
        for prompt in self.tuning[: int(self.cfg.warmup_prompts)]:
            measure_prompt(method, prompt, self.ids[prompt.id], self.budget["max_new_tokens"],
                           self.tokenizer, self.device)
        if hasattr(method, "reset"):       # warm-up must not seed the measured phrase pool
            method.reset()

    def baseline(self) -> dict[str, dict]:
        """Vanilla on the tuning prompts, measured once per study and kept in it."""
        stored = self.study.user_attrs.get("baseline")
        if stored and set(stored) >= {p.id for p in self.tuning}:
            say(f"baseline: reusing the vanilla measurements stored in study {self.cfg.study_name}")
            return stored
        say("baseline: measuring vanilla decoding on the tuning prompts ...")
        vanilla = self._method({"_target_": "decoding.vanilla.Vanilla"}, {})
        self._warmup(vanilla)
        with EnergyMeter() as meter:
            ms = [measure_prompt(vanilla, p, self.ids[p.id], self.budget["max_new_tokens"],
                                 self.tokenizer, self.device) for p in self.tuning]
        baseline = {m.prompt_id: {"tokens": list(m.tokens), "wall_s": m.wall_s} for m in ms}
        self.study.set_user_attr("baseline", baseline)
        summary = summarize(ms, meter.reading, self.device)
        self.study.set_user_attr("baseline_summary", summary)
        self.study.set_user_attr("energy", meter.reading.reason)
        self.tracker.log_run("baseline", {"method": "vanilla"}, summary,
                             {"kind": "baseline", "energy": meter.reading.reason},
                             [asdict(m) for m in ms])
        say(f"baseline: {summary['tokens_per_s']:.2f} tok/s over {len(ms)} prompts "
            f"({'energy: ' + meter.reading.reason})")
        return baseline

    def evaluate(self, trial: optuna.Trial, params: dict, baseline: dict) -> tuple[dict, list]:
        method = self._method(self.method_cfg, params)
        self._warmup(method)
        order = list(enumerate(self.tuning))
        random.Random(f"{self.cfg.seed}-{trial.number}").shuffle(order)
        ms: list[Measurement] = []
        with EnergyMeter() as meter:
            for done, (index, prompt) in enumerate(order, 1):
                m = measure_prompt(method, prompt, self.ids[prompt.id],
                                   self.budget["max_new_tokens"], self.tokenizer, self.device)
                m = replace(m, speedup=baseline[prompt.id]["wall_s"] / m.wall_s)
                if self.greedy and self.method_cfg.get("lossless"):
                    m = check_against_vanilla(m, baseline[prompt.id]["tokens"],
                                              self.ids[prompt.id], self.pair.target,
                                              float(self.cfg.near_tie_tolerance))
                ms.append(m)
                say(f"  trial {trial.number} prompt {done}/{len(order)}: {m.new_tokens} tokens "
                    f"{m.tokens_per_s:.2f} tok/s speedup {m.speedup:.3f}")
                if len(self.directions) == 1:
                    trial.report(m.speedup, step=index)
                    if done < len(order) and trial.should_prune():
                        trial.set_user_attr("pruned_at", done)
                        say(f"  trial {trial.number} pruned after {done} prompts")
                        break
        summary = summarize(ms, meter.reading, self.device)
        if len(ms) == len(order):
            quality, _ = self.task.score([p for _, p in order], [m.text for m in ms])
            summary.update({f"quality_{k}": v for k, v in quality.items()})
        return summary, ms

    def objective_values(self, summary: dict) -> list[float]:
        if len(self.directions) == 1:
            return [summary["speedup"]]
        return [summary["tokens_per_s"], summary["energy_j_per_token"]]

    # -- the search --------------------------------------------------------------------------

    def plan(self):
        kind = self.cfg.search.kind
        if kind == "heuristic":
            return HeuristicPlan(self.space, self.task.task_class, int(self.cfg.seed))
        if kind == "grid":
            ranges = self.cfg.search.get("ranges", "heuristic")
            if ranges not in ("heuristic", "full"):
                raise ValueError(f"search.ranges={ranges!r} is invalid: allowed are heuristic, full")
            return GridPlan(self.space, self.default,
                            self.task.task_class if ranges == "heuristic" else None)
        if kind == "sampler":
            return None
        raise ValueError(f"search kind={kind!r} is unknown: allowed are heuristic, grid, sampler")

    def results(self) -> dict[tuple, float]:
        out = {}
        for t in self.study.get_trials(deepcopy=False):
            if t.state == TrialState.COMPLETE and "pruned_at" not in t.user_attrs:
                out[point_key(t.params)] = t.values[0]
            elif t.state == TrialState.FAIL and not _orphaned(t):
                out[point_key(t.params)] = -math.inf
        return out

    def next_trial(self, plan) -> optuna.Trial | None:
        waiting = self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
        if self._spent() == 0 and not waiting:          # trial 0: the default (paper) setting
            self.study.enqueue_trial(self.default, user_attrs={"stage": "default"})
        elif plan is not None and not waiting:
            step = plan.next_point(self.results())
            if step is None:
                return None
            self.study.enqueue_trial(step[0], user_attrs={"stage": step[1]})
        trial = self.study.ask()
        for name, dist in distributions(self.space).items():
            trial._suggest(name, dist)
        trial.set_user_attr("host", socket.gethostname())
        trial.set_user_attr("pid", os.getpid())
        return trial

    def run_trials(self, baseline: dict) -> None:
        plan = self.plan()
        limit = self.budget["n_trials"] if plan is None else min(self.budget["n_trials"],
                                                                  plan.size() + 1)
        began, timeout = time.monotonic(), self.cfg.search.get("timeout")
        while self._spent() < limit:
            if timeout and time.monotonic() - began > float(timeout):
                say(f"search.timeout={timeout}s reached: no new trials")
                break
            trial = self.next_trial(plan)
            if trial is None:
                break
            stage = trial.user_attrs.get("stage", self.cfg.search.kind)
            say(f"trial {trial.number} [{stage}] {trial.params}")
            try:
                summary, ms = self.evaluate(trial, dict(trial.params), baseline)
                values = self.objective_values(summary)
            except (Exception, torch.OutOfMemoryError) as err:   # noqa: BLE001 - never kill it
                message = f"{type(err).__name__}: {err}"
                trial.set_user_attr("error", message)
                self.study.tell(trial, state=TrialState.FAIL)
                self.tracker.log_run(f"trial-{trial.number}", trial.params, {},
                                     {"kind": "trial", "state": "FAIL", "error": message[:500],
                                      "stage": stage})
                say(f"trial {trial.number} FAILED: {message}")
                if isinstance(err, LosslessViolation):
                    say("  (a lossless method diverged from vanilla: this is a bug, not a bad "
                        "hyperparameter)")
                continue
            for key in ("speedup", "tokens_per_s", "mean_accepted_tokens", "acceptance_rate"):
                trial.set_user_attr(key, summary.get(key))
            self.study.tell(trial, values)
            self.tracker.log_run(f"trial-{trial.number}", trial.params, summary,
                                 {"kind": "trial", "state": "COMPLETE", "stage": stage,
                                  "energy": str(self.study.user_attrs.get("energy", ""))},
                                 [asdict(m) for m in ms])
            say(f"trial {trial.number} done: speedup {summary['speedup']:.3f} "
                f"({summary['tokens_per_s']:.2f} tok/s, mean accepted "
                f"{summary['mean_accepted_tokens']:.2f})")

    def _spent(self) -> int:
        """Trials that used budget: finished ones, except orphans (their points are retried)."""
        return sum(1 for t in self.study.get_trials(deepcopy=False)
                   if t.state in (TrialState.COMPLETE, TrialState.PRUNED) or
                   (t.state == TrialState.FAIL and not _orphaned(t)))

    def best_params(self) -> tuple[dict, dict] | None:
        done = [t for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                if "pruned_at" not in t.user_attrs]
        if not done:
            return None
        if len(self.directions) > 1:
            front = self.study.best_trials
            best = max(front, key=lambda t: t.values[0])
        else:
            best = max(done, key=lambda t: t.values[0])
        return dict(best.params), {"trial": best.number, "value": best.values[0]}

    def confirm(self, params: dict) -> dict[str, float]:
        """Best configuration vs vanilla on held-out prompts never used by the search."""
        if not self.held_out:
            return {}
        say(f"held-out confirmation on {len(self.held_out)} prompts: vanilla vs {params}")
        vanilla = self._method({"_target_": "decoding.vanilla.Vanilla"}, {})
        best = self._method(self.method_cfg, params)
        self._warmup(vanilla)
        self._warmup(best)
        pairs = []
        for p in self.held_out:   # interleaved, so drift hits both alike
            ref = measure_prompt(vanilla, p, self.ids[p.id], self.budget["max_new_tokens"],
                                 self.tokenizer, self.device)
            got = measure_prompt(best, p, self.ids[p.id], self.budget["max_new_tokens"],
                                 self.tokenizer, self.device)
            got = replace(got, speedup=ref.wall_s / got.wall_s)
            if self.greedy and self.method_cfg.get("lossless"):
                got = check_against_vanilla(got, ref.tokens, self.ids[p.id], self.pair.target,
                                            float(self.cfg.near_tie_tolerance))
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
        quality, _ = self.task.score(self.held_out, [g.text for _, g in pairs])
        out.update({f"held_out_quality_{k}": v for k, v in quality.items()})
        return out


def write_best_yaml(cfg: DictConfig, params: dict, confirmed: dict) -> Path:
    folder = Path(cfg.studies_dir) / "best"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{cfg.study_name}.yaml"
    speed = confirmed.get("held_out_speedup")
    header = (f"# @package _global_\n# Best configuration of study {cfg.study_name}"
              f"{f' (held-out speedup {speed:.3f}x vs vanilla)' if speed else ''}.\n"
              f"# Replay: python -m tuner +task={cfg.task.name} "
              f"method={cfg.method._target_.split('.')[-1].lower()} +best={cfg.study_name}\n")
    body = OmegaConf.to_yaml({"method": {"params": params}})
    path.write_text(header + body)
    return path


def optuna_figures(study: optuna.Study) -> dict[str, Any]:
    figures = {}
    try:
        from optuna import visualization as vis
        figures["optimization_history"] = vis.plot_optimization_history(
            study, target=lambda t: t.values[0], target_name="objective")
        figures["slice"] = vis.plot_slice(study, target=lambda t: t.values[0],
                                          target_name="objective")
    except (ImportError, ValueError) as err:
        say(f"plots skipped: {err}")
    return figures


def print_summary(cfg: DictConfig, params: dict, best: dict, confirmed: dict,
                  summary: dict, budget: dict) -> None:
    rows = [("study", cfg.study_name), ("budget", f"{budget['n_prompts']} tuning + "
             f"{budget['n_held_out']} held-out prompts, {budget['max_new_tokens']} new tokens"),
            ("best parameters", params),
            ("best trial (tuning prompts)", f"#{best['trial']}, objective {best['value']:.3f}")]
    if confirmed:
        rows += [("held-out speedup vs vanilla",
                  f"{confirmed['held_out_speedup']:.3f}x (min {confirmed['held_out_speedup_min']:.3f}"
                  f", max {confirmed['held_out_speedup_max']:.3f})"),
                 ("held-out tokens/s", f"{confirmed['held_out_tokens_per_s']:.2f} (vanilla "
                  f"{confirmed['held_out_vanilla_tokens_per_s']:.2f})"),
                 ("held-out mean accepted tokens",
                  f"{confirmed['held_out_mean_accepted_tokens']:.2f}")]
        if "held_out_matches_vanilla" in confirmed:
            rows.append(("held-out identical to vanilla",
                         f"{confirmed['held_out_matches_vanilla']:.0%}"))
    rows += [("acceptance rate (tuning)", f"{summary.get('acceptance_rate', 0):.3f}"),
             ("energy", f"{summary['energy_j_per_token']:.3f} J/token"
              if "energy_j_per_token" in summary else "unavailable")]
    say("\n" + "=" * 78)
    for key, value in rows:
        say(f"{key:<32} {value}")
    if confirmed and confirmed["held_out_speedup"] <= 1.0:
        say("RECOMMENDATION: nothing beat vanilla on the held-out prompts: use vanilla decoding "
            "on this hardware/model pair.")
    say("=" * 78)


def run(cfg: DictConfig) -> dict[str, Any]:
    """Run (or resume) the study described by ``cfg``; returns the final summary."""
    s = Study(cfg)
    if len(s.directions) > 1:
        meter = EnergyMeter()
        if not meter.available:
            raise ValueError(f"search=pareto needs GPU energy measurements, which are unavailable "
                             f"here: {meter.reason}")
    say(f"study {cfg.study_name}: task {s.task.name} ({s.task.task_class}), method "
        f"{cfg.method._target_}, {len(s.tuning)} tuning + {len(s.held_out)} held-out prompts, "
        f"{s.budget['max_new_tokens']} new tokens, device {s.device}, search {cfg.search.kind}, "
        f"grid size {grid_size(s.space)} (heuristic ranges: "
        f"{grid_size(s.space, s.task.task_class)})")
    fail_orphans(s.study)
    s.tracker.start_study(cfg.study_name, {"task": s.task.name, "method": cfg.method._target_,
                                           "models": str(plain(cfg.models)),
                                           "search": cfg.search.kind},
                          OmegaConf.to_yaml(OmegaConf.masked_copy(
                              cfg, [k for k in cfg if k != "hydra"]), resolve=True), s.device)
    try:
        baseline = s.baseline()
        s.run_trials(baseline)
        found = s.best_params()
        if found is None:
            raise RuntimeError("no trial completed; see the FAIL reasons above")
        params, best = found
        confirmed = s.confirm(params)
        best_trial = s.study.trials[best["trial"]]
        summary = dict(best_trial.user_attrs)
        path = write_best_yaml(cfg, params, confirmed)
        s.tracker.log_best({**{k: v for k, v in summary.items() if isinstance(v, (int, float))},
                            **confirmed}, params, optuna_figures(s.study), {"best": path})
        print_summary(cfg, params, best, confirmed, summary, s.budget)
        say(f"best configuration written to {path}")
        return {"params": params, **best, **confirmed}
    finally:
        s.tracker.close()
