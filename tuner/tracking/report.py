"""What a finished study tells its user: the summary table, the best-config YAML, Optuna plots.

The same summary goes to the terminal and to the MLflow parent run's description (markdown), so the
MLflow UI shows the winner, its held-out speedup and the recommendation at a glance.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import optuna

from tuner.measure.figures import split_level
from tuner.study.record import TrialRecord
from tuner.answer.verdict import held_out, quality_line, relative, verdict_key


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





def objective_name(objective: str) -> str:
    """How the summary names a first objective."""
    base, level = split_level(objective)
    name = {"speedup": "paired speedup (end to end)",
            "decode_speedup": "paired decode-phase speedup (prefill left out)"}.get(base, base)
    return f"{name} at concurrency {level}" if level else name


def is_ratio(objective: str) -> bool:
    return split_level(objective)[0] in ("speedup", "decode_speedup", "throughput_ratio")


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
                     f"token left out, mean {trial_summary.get('ttft_ms', float('nan')):.0f} ms"
                     + (f"; {trial_summary['decode_tokens_per_step']:.2f} tokens per decode step"
                        if "decode_tokens_per_step" in trial_summary else "") + ")"))
    if confirmed:
        verdict = verdict_key(objective, confirmed)
        decode = "held_out_decode_speedup" in confirmed
        end_to_end = ("held-out speedup vs vanilla" if not decode else
                      "held-out end-to-end speedup" if verdict == "speedup" else
                      "held-out end to end (beside it)",
                      f"{confirmed['held_out_speedup']:.3f}x, "
                      f"{relative(confirmed['held_out_speedup'])}"
                      f"{' end to end' * decode} (geometric mean of "
                      f"{int(confirmed.get('held_out_prompts', 0))} prompts x "
                      f"{budget['max_new_tokens']} tokens; per prompt min "
                      f"{confirmed['held_out_speedup_min']:.3f}, max "
                      f"{confirmed['held_out_speedup_max']:.3f}"
                      f"{lower_text(confirmed, 'speedup')}"
                      f"{'; the verdict below reads this' * (verdict == 'speedup')})")
        phase = ("held-out decode-phase speedup", decode_line(confirmed, verdict)) \
            if decode else None
        # the figure the verdict reads comes first; the other stands beside it, labelled
        rows += [*([phase, end_to_end] if decode and verdict == "decode_speedup" else
                   [end_to_end, phase] if decode else [end_to_end]),
                 ("held-out tokens/s", f"{confirmed['held_out_tokens_per_s']:.2f} (vanilla "
                  f"{confirmed['held_out_vanilla_tokens_per_s']:.2f})"),
                 ("held-out mean accepted tokens",
                  f"{confirmed['held_out_mean_accepted_tokens']:.2f} per target forward (the "
                  "prefill counted)" + (f", {confirmed['held_out_decode_tokens_per_step']:.2f} "
                                        "per decode step" if
                                        "held_out_decode_tokens_per_step" in confirmed else ""))]
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


def decode_line(confirmed: Mapping[str, Any], verdict: str) -> str:
    speed = confirmed["held_out_decode_speedup"]
    spread = (f", per prompt min {confirmed['held_out_decode_speedup_min']:.3f}, max "
              f"{confirmed['held_out_decode_speedup_max']:.3f}"
              if "held_out_decode_speedup_min" in confirmed else "")
    reads = "; the verdict below reads this" * (verdict == "decode_speedup")
    return (f"{speed:.3f}x, {relative(speed)} (prefill left out{spread}"
            f"{lower_text(confirmed, 'decode_speedup')}{reads})")


def lower_text(confirmed: Mapping[str, Any], key: str) -> str:
    low = confirmed.get(f"held_out_{key}_lcb")
    return f"; 95 % lower bound {low:.3f}" if low else ""


def markdown(rows: list[tuple[str, str]], advice: str) -> str:
    lines = [f"**Recommendation: {advice}**", "", "| | |", "|---|---|"]
    lines += [f"| {key} | {str(value).replace('|', '/')} |" for key, value in rows]
    return "\n".join(lines)





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
