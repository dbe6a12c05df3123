"""What a finished study tells its user: the summary table, the best-config YAML, Optuna plots.

The same summary goes to the terminal and to the MLflow parent run's description (markdown), so the
MLflow UI shows the winner, its held-out speedup and the recommendation at a glance.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import optuna
from omegaconf import OmegaConf

from tuner.engines.base import Engine
from tuner.study.record import TrialRecord


def describe(settings, created: bool, limit: int) -> str:
    """The study's header: what is measured, where, how, and at most how many trials."""
    from tuner.config.identity import hardware
    engine = settings.engine["kind"]
    levels = "" if settings.concurrency == (1,) else \
        f", concurrency levels {list(settings.concurrency)}"
    return (f"study {settings.name} ({'new' if created else 'resumed'}): task "
            f"{settings.task.name} ({settings.task.task_class}), method "
            f"{settings.method_choice} ({settings.method['_target_']}), engine {engine}, "
            f"{len(settings.tuning)} tuning + {len(settings.held_out)} held-out prompts, "
            f"{settings.budget['max_new_tokens']} new tokens{levels}, device {settings.device} "
            f"({hardware(settings.device)}), search {settings.search['kind']} (at most {limit} "
            f"trials), baseline {settings.baseline}")


QUALITY_KEYS = ("held_out_perplexity_ratio", "held_out_quality_drop", "held_out_feasible")


def held_out(confirmed: Mapping[str, Any]) -> dict[str, Any]:
    """The held-out confirmation's numbers without their ``held_out_`` prefix."""
    return {k.removeprefix("held_out_"): v for k, v in confirmed.items()
            if k.startswith("held_out_")}


def objective_name(objective: str) -> str:
    """How the summary names a first objective."""
    base, _, level = objective.partition("@c")
    name = {"speedup": "paired speedup (end to end)",
            "decode_speedup": "paired decode-phase speedup (prefill left out)"}.get(base, base)
    return f"{name} at concurrency {level}" if level else name


def is_ratio(objective: str) -> bool:
    return objective.partition("@c")[0] in ("speedup", "decode_speedup", "throughput_ratio")


def summary_rows(study_name: str, params: Mapping[str, Any], best: Mapping[str, Any],
                 confirmed: Mapping[str, float], trial_summary: Mapping[str, Any],
                 budget: Mapping[str, int], notes: list[str], energy_reason: str = "",
                 quality_bound: str | None = None,
                 objective: str = "speedup") -> list[tuple[str, str]]:
    """The summary table; ``quality_bound`` (lossy methods or a bound set) adds quality rows;
    ``objective``: the first objective, which ``best['value']`` holds."""
    rows = [("study", study_name),
            ("budget", f"{budget['n_prompts']} tuning + {budget['n_held_out']} held-out prompts, "
                       f"{budget['max_new_tokens']} new tokens, {best['trials']} trials"),
            ("best parameters", ", ".join(f"{k}={v}" for k, v in params.items()) or "(none)"),
            ("best trial (tuning prompts)", f"#{best['trial']}, {objective_name(objective)} "
                                            f"{best['value']:.3f}{'x' * is_ratio(objective)} on "
                                            f"{budget['n_prompts']} prompts")]
    if "decode_speedup" in trial_summary:
        rows.append(("decode-phase speedup (tuning)",
                     f"{trial_summary['decode_speedup']:.3f}x (end to end "
                     f"{trial_summary.get('speedup', float('nan')):.3f}x; the time to the first "
                     f"token left out, mean {trial_summary.get('ttft_ms', float('nan')):.0f} ms)"))
    if confirmed:
        verdict = verdict_key(objective, confirmed)
        decode = "held_out_decode_speedup" in confirmed
        rows += [("held-out speedup vs vanilla",
                  f"{confirmed['held_out_speedup']:.3f}x, {relative(confirmed['held_out_speedup'])}"
                  f"{' end to end' * decode} (geometric mean of "
                  f"{int(confirmed.get('held_out_prompts', 0))} prompts x "
                  f"{budget['max_new_tokens']} tokens; per prompt min "
                  f"{confirmed['held_out_speedup_min']:.3f}, max "
                  f"{confirmed['held_out_speedup_max']:.3f}"
                  f"{'; the verdict below reads this' * (decode and verdict == 'speedup')})"),
                 *([("held-out decode-phase speedup", decode_line(confirmed, verdict))]
                   if decode else []),
                 ("held-out tokens/s", f"{confirmed['held_out_tokens_per_s']:.2f} (vanilla "
                  f"{confirmed['held_out_vanilla_tokens_per_s']:.2f})"),
                 ("held-out mean accepted tokens",
                  f"{confirmed['held_out_mean_accepted_tokens']:.2f}")]
        if "held_out_matches_vanilla" in confirmed:
            rows.append(("held-out identical to vanilla",
                         f"{confirmed['held_out_matches_vanilla']:.0%}"))
    rows.append(("acceptance rate (tuning)", f"{trial_summary.get('acceptance_rate', 0):.3f}"))
    if quality_bound is not None:
        rows.append(("quality bound", quality_bound))
        rows.append(("quality vs vanilla (tuning)", quality_line(trial_summary)))
        if confirmed:
            held = held_out(confirmed)
            rows.append(("quality vs vanilla (held-out)", quality_line(held)))
    energy = trial_summary.get("energy_j_per_token")
    ratio = trial_summary.get("energy_ratio")
    rows.append(("energy", (f"{energy:.3f} J/token" + (f" ({ratio:.3f}x vanilla's)" if ratio
                                                        else "")) if isinstance(energy, (
                     int, float)) else f"unavailable ({energy_reason or 'no NVML'})"))
    rows += [("note", note) for note in notes]
    return rows


def verdict_key(objective: str, confirmed: Mapping[str, Any]) -> str:
    """Which held-out speedup the verdict reads: the decode phase's where the study was chosen
    by it (``decode_speedup``, at any level) and the confirmation measured it, else the
    end-to-end one. The winner is judged on held-out prompts by what it was chosen by."""
    if objective.partition("@c")[0] == "decode_speedup" and \
            "held_out_decode_speedup" in confirmed:
        return "decode_speedup"
    return "speedup"


def decode_line(confirmed: Mapping[str, Any], verdict: str) -> str:
    speed = confirmed["held_out_decode_speedup"]
    spread = (f", per prompt min {confirmed['held_out_decode_speedup_min']:.3f}, max "
              f"{confirmed['held_out_decode_speedup_max']:.3f}"
              if "held_out_decode_speedup_min" in confirmed else "")
    reads = "; the verdict below reads this" * (verdict == "decode_speedup")
    return f"{speed:.3f}x, {relative(speed)} (prefill left out{spread}{reads})"


def quality_line(values: Mapping[str, Any]) -> str:
    """E.g. 'perplexity 4.10 vs vanilla 4.32 (ratio 0.949), quality drop +0.000, within the
    bound'."""
    parts = []
    if "perplexity" in values:
        parts.append(f"perplexity {values['perplexity']:.3f} vs vanilla "
                     f"{values['vanilla_perplexity']:.3f} "
                     f"(ratio {values['perplexity_ratio']:.3f})")
    if "quality_drop" in values:
        parts.append(f"quality drop {values['quality_drop']:+.3f}")
    if values.get("feasible") is not None:
        parts.append("within the bound" if values["feasible"] else "BREAKS the bound")
    return ", ".join(parts) or "not scored"


def relative(ratio: float) -> str:
    """1.25 -> '25 % faster than vanilla', 0.84 -> '16 % slower than vanilla'."""
    if abs(ratio - 1.0) < 0.005:
        return "as fast as vanilla"
    return f"{abs(ratio - 1) * 100:.0f} % {'faster' if ratio > 1 else 'slower'} than vanilla"


def recommendation(confirmed: Mapping[str, float], min_held_out: int = 3,
                   objective: str = "speedup") -> str:
    """What to do, and only as much as the held-out evidence supports; judged by the held-out
    speedup of the kind the winner was chosen by (``verdict_key``), named in the text."""
    if not confirmed:
        return "no held-out prompts: the winner is unconfirmed (task.n_held_out=0)"
    key = verdict_key(objective, confirmed)
    phase = " in the decode phase" if key == "decode_speedup" else ""
    speed = confirmed[f"held_out_{key}"]
    low = confirmed.get(f"held_out_{key}_min", speed)
    high = confirmed.get(f"held_out_{key}_max", speed)
    prompts = int(confirmed.get("held_out_prompts", 0))
    if speed <= 1.0:
        return (f"nothing beat vanilla on the held-out prompts (the winner: {speed:.2f}x"
                f"{phase}, {relative(speed)}): use vanilla decoding on this hardware/model pair")
    if prompts < min_held_out:
        return (f"not enough evidence: the winner ran {speed:.2f}x vanilla{phase} on only "
                f"{prompts} held-out prompt(s) (min {low:.2f}x, max {high:.2f}x), fewer than "
                f"min_held_out_prompts={min_held_out}: keep vanilla decoding, or confirm on more "
                "prompts (task.n_held_out, then +best=<study> to replay)")
    if confirmed.get("held_out_feasible") == 0.0:
        held = held_out(confirmed)
        return (f"the winner ran {speed:.2f}x vanilla{phase} on held-out "
                f"prompts but broke the quality bound there ({quality_line(held)}): prefer "
                "vanilla decoding unless that loss is acceptable")
    lossy = ""
    if "held_out_perplexity_ratio" in confirmed:
        lossy = (f" (lossy: perplexity {confirmed['held_out_perplexity_ratio']:.3f}x vanilla's"
                 + (f", quality drop {confirmed['held_out_quality_drop']:+.3f}"
                    if "held_out_quality_drop" in confirmed else "") + ")")
    return (f"use the best parameters: {speed:.2f}x vanilla{phase} ({relative(speed)}) on "
            f"{prompts} held-out prompts, min {low:.2f}x, max {high:.2f}x{lossy}")


def with_exceptions(advice: str, on_at: list[str]) -> str:
    """A recommendation to stay with vanilla that names the levels / rates whose own lines say
    ON, so the summary never reads as two answers."""
    if not on_at or "vanilla decoding" not in advice:
        return advice
    return (f"{advice}; except where the lines above say ON ({', '.join(on_at)}): there, the "
            "setting that line names")


def print_summary(rows: list[tuple[str, str]], advice: str, say) -> None:
    say("\n" + "=" * 78)
    for key, value in rows:
        say(f"{key:<32} {value}")
    say(f"RECOMMENDATION: {advice}")
    say("=" * 78)


def markdown(rows: list[tuple[str, str]], advice: str) -> str:
    lines = [f"**Recommendation: {advice}**", "", "| | |", "|---|---|"]
    lines += [f"| {key} | {str(value).replace('|', '/')} |" for key, value in rows]
    return "\n".join(lines)


REPLAYED_GROUPS = ("models", "engine", "budget")     # config groups the best YAML re-selects


def write_best_yaml(folder: Path, settings: Any, params: Mapping[str, Any],
                    best: Mapping[str, Any], confirmed: Mapping[str, float],
                    deploy: Mapping[str, Any] | None = None) -> Path:
    """The winner as a Hydra config that replays as printed: every parameter that built it
    (searched and fixed), the config groups it ran with (models, engine, budget), its sampling,
    seed and budget (task sizes), and, for an engine server, how to deploy it."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{settings.name}.yaml"
    speed = confirmed.get("held_out_speedup")
    key = verdict_key(settings.objectives[0], confirmed)      # what the verdict read
    shown = confirmed.get(f"held_out_{key}")
    kind = "decode-phase speedup" if key == "decode_speedup" else "speedup"
    task = settings.task.name
    header = (f"# @package _global_\n# Best configuration of study {settings.name}"
              f"{f' (held-out {kind} {shown:.3f}x vs vanilla)' if shown else ''}.\n"
              f"# Replay (a fresh paired measurement against vanilla on the study's held-out "
              f"prompts and budget):\n#   python -m tuner +task={task} "
              f"method={settings.method_choice} +best={settings.name}\n")
    where = settings.engine_object.best_params(settings.method_choice, params)
    body = {"defaults": [{f"override /{group}": choice}
                         for group, choice in settings.choices.items()
                         if group in REPLAYED_GROUPS and choice],
            **where, "models": dict(settings.models), "sampling": dict(settings.sampling),
            "seed": settings.seed,
            "budget": {"concurrency": list(settings.concurrency),
                       **({"request_rate": list(settings.traffic.rates),
                           "requests_per_rate": settings.traffic.requests_per_rate}
                          if settings.traffic.rates else {})},
            **({"search": {"slo": dict(settings.traffic.slo)}} if settings.traffic.slo else {}),
            "task": {"n_prompts": settings.budget["n_prompts"],
                     "n_held_out": settings.budget["n_held_out"],
                     "max_new_tokens": settings.budget["max_new_tokens"]},
            "replay": {"study": settings.name, "trial": best["trial"],
                       "budget": {**{k: settings.budget[k] for k in ("n_prompts", "n_held_out",
                                                                     "max_new_tokens")},
                                  "concurrency": list(settings.concurrency)},
                       "tuning_objective": settings.objectives[0],   # what tuning_speedup holds
                       "tuning_speedup": float(best["value"]),
                       "held_out_speedup": float(speed) if speed else None,
                       **({"held_out_decode_speedup": float(confirmed["held_out_decode_speedup"])}
                          if "held_out_decode_speedup" in confirmed else {}),
                       **{k: float(confirmed[k]) for k in QUALITY_KEYS if k in confirmed}}}
    if deploy:
        body["deploy"] = dict(deploy)
    path.write_text(header + OmegaConf.to_yaml(body))
    return path


def plots_html(study: optuna.Study, path: Path) -> Path | None:
    """Optimization history (with best-so-far and a vanilla = 1.0 line) and slices, one offline
    HTML page (plotly.js embedded once, no CDN: the MLflow UI may run without internet)."""
    try:
        from optuna import visualization as vis
        name = objective_name(study.metric_names[0]) if study.metric_names else "speedup"
        history = vis.plot_optimization_history(study, target=lambda t: t.values[0],
                                                target_name=f"{name} vs vanilla")
        history.add_hline(y=1.0, line_dash="dash", line_color="gray",
                          annotation_text="vanilla = 1.0")
        numbers, best = best_so_far(study)
        history.add_scatter(x=numbers, y=best, mode="lines", name="best so far",
                            line={"shape": "hv", "color": "firebrick"})
        figures = [history]
        if study.best_trials and study.best_trials[0].params:
            figures.append(vis.plot_slice(study, target=lambda t: t.values[0],
                                          target_name=name))
    except (ImportError, ValueError, RuntimeError):
        return None
    parts = [f.to_html(full_html=False, include_plotlyjs=(i == 0)) for i, f in enumerate(figures)]
    path.write_text("<!doctype html><html><head><meta charset='utf-8'><title>"
                    f"{study.study_name}</title></head><body>{''.join(parts)}</body></html>")
    return path


def best_so_far(study: optuna.Study) -> tuple[list[int], list[float]]:
    """Best first-objective value so far over feasible trials (speedup: maximised)."""
    numbers, best, top = [], [], float("-inf")
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        if TrialRecord.read(t).infeasible:
            continue
        top = max(top, t.values[0])
        numbers.append(t.number)
        best.append(top)
    return numbers, best


def plots_png(study: optuna.Study, path: Path) -> Path | None:
    """The same history as a PNG: the MLflow UI previews images inline (large HTML it does not).
    None without matplotlib (the full MLflow installs it; its skinny client, as on a GPU kit, not)."""
    numbers, best = best_so_far(study)
    if not numbers:
        return None
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    done = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    fig, ax = plt.subplots(figsize=(8, 4), dpi=110)
    ax.scatter([t.number for t in done], [t.values[0] for t in done], label="trial")
    ax.step(numbers, best, where="post", color="firebrick", label="best so far")
    ax.axhline(1.0, color="gray", linestyle="--", label="vanilla = 1.0")
    ax.set_xlabel("trial")
    name = objective_name(study.metric_names[0]) if study.metric_names else "speedup"
    ax.set_ylabel(f"{name} vs vanilla")
    ax.set_title(study.study_name)
    ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def compare_previous(folder: Path, family: str, name: str, params: Mapping[str, Any],
                     confirmed: Mapping[str, float]) -> str | None:
    """For scheduled re-runs (``<family>-<tag>`` studies): did the winner or its speedup change?"""
    import yaml
    earlier = sorted(p for p in folder.glob(f"{family}-*.yaml") if p.stem < name
                     and not p.stem.endswith((".plots", ".history")))
    if not earlier:
        return None
    previous = yaml.safe_load(earlier[-1].read_text())
    old_params = Engine.recorded_params(previous)
    old_speed = (previous.get("replay") or {}).get("held_out_speedup")
    changed = {k: (old_params.get(k), v) for k, v in params.items() if old_params.get(k) != v}
    what = ("best parameters unchanged" if not changed else "best parameters changed: " +
            ", ".join(f"{k} {a} -> {b}" for k, a, b in ((k, *v) for k, v in changed.items())))
    new_speed = confirmed.get("held_out_speedup")
    if isinstance(old_speed, (int, float)) and new_speed:
        what += (f"; held-out speedup {old_speed:.3f}x -> {new_speed:.3f}x "
                 f"({(new_speed / old_speed - 1) * 100:+.1f} %)")
    return f"since {earlier[-1].stem}: {what}"
