"""The paired pruner (tuner.search.pruners) acts at the 3 prompts of a CPU study, where Optuna's
WilcoxonPruner cannot; a Wilcoxon configuration that can never prune is refused in one line."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import optuna
import pytest

from tests.conftest import ROOT
from tuner.config.errors import ConfigError
from tuner.search.pruners import PairedPruner

DIST = optuna.distributions.IntDistribution(0, 100)
# per-prompt paired speedups of completed trials on 3 prompts (steps 0, 1, 2): the best (0.80
# geometric mean) and two others measured with the usual few-% spread between prompts
DONE = [[0.80, 0.74, 0.87], [0.76, 0.71, 0.85], [0.70, 0.66, 0.74]]


def study_with(done=DONE, pruner=None) -> optuna.Study:
    study = optuna.create_study(direction="maximize", pruner=pruner or PairedPruner())
    for i, values in enumerate(done):
        study.add_trial(optuna.trial.create_trial(
            params={"x": i}, distributions={"x": DIST},
            value=math.exp(sum(math.log(v) for v in values) / len(values)),
            intermediate_values=dict(enumerate(values))))
    return study


def pruned_after(study: optuna.Study, values: list[float], order=(0, 1, 2)) -> int | None:
    """Report ``values`` prompt by prompt as the objective does (asking after every prompt but
    the last); the prompt count at which it was pruned, or None."""
    trial = study.ask({"x": DIST})
    for n, step in enumerate(order, 1):
        trial.report(values[step], step)
        if n < len(order) and trial.should_prune():
            return n
    return None


def test_a_clearly_worse_trial_is_pruned_at_three_prompts():
    """0.55x against a best of 0.80x on the same prompts (31 % behind): pruned before its last
    prompt, in either order of the prompts; Optuna's WilcoxonPruner at p 0.1 cannot."""
    worse = [0.56, 0.52, 0.60]
    assert pruned_after(study_with(), worse) in (1, 2)
    assert pruned_after(study_with(), worse, order=(2, 0, 1)) in (1, 2)
    wilcoxon = optuna.pruners.WilcoxonPruner(p_threshold=0.1, n_startup_steps=2)
    assert pruned_after(study_with(pruner=wilcoxon), worse) is None


@pytest.mark.parametrize("values", [
    [0.80, 0.74, 0.87],           # the best's own values
    [0.79, 0.73, 0.86],           # 1 % behind
    [0.83, 0.70, 0.86],           # 1 % behind on average, unevenly
])
def test_a_trial_within_the_margin_is_not_pruned(values):
    assert pruned_after(study_with(), values) is None


def test_nothing_is_pruned_before_the_pooled_spread_is_known():
    """One completed trial (the best) gives no spread of differences: no judgement yet."""
    assert pruned_after(study_with(done=DONE[:1]), [0.40, 0.40, 0.40]) is None


def test_a_wider_spread_between_prompts_makes_it_wait():
    """The same mean gap, with trials whose differences to the best scatter widely across
    prompts: the bound is wider, and the trial is not pruned after one prompt."""
    wide = [[0.80, 0.74, 0.87], [0.95, 0.55, 0.90], [0.55, 0.80, 0.70]]
    narrow = pruned_after(study_with(), [0.70, 0.66, 0.76])
    assert narrow is not None
    assert pruned_after(study_with(done=wide), [0.70, 0.66, 0.76]) is None


def test_bad_pruner_arguments_are_refused():
    for kwargs in ({"margin": 1.0}, {"alpha": 0.0}, {"min_df": 0}):
        with pytest.raises(ValueError):
            PairedPruner(**kwargs)


def test_a_wilcoxon_pruner_that_can_never_prune_is_refused_in_one_line(tmp_path):
    """budget=auto measures 3 tuning prompts: WilcoxonPruner(p_threshold=0.1) is asked after 2,
    where its smallest p is 0.25: refused, naming it; at 6 prompts (smallest p 1/32) it is
    accepted; search=tpe's default pruner is accepted at 3."""
    from tests.conftest import compose_cfg
    from tuner.study.settings import StudySettings
    wilcoxon = ["~search.pruner",
                "+search.pruner={_target_:optuna.pruners.WilcoxonPruner,p_threshold:0.1}"]
    with pytest.raises(ConfigError) as err:
        StudySettings.from_config(compose_cfg(tmp_path, "search=tpe", "task.n_prompts=3",
                                              *wilcoxon))
    message = str(err.value)
    assert "\n" not in message
    assert "WilcoxonPruner(p_threshold=0.1) can never prune at 3 tuning prompt(s)" in message
    assert "smallest p a signed-rank test reaches is 0.25" in message
    StudySettings.from_config(compose_cfg(tmp_path, "search=tpe", "budget=full",
                                          "task.n_prompts=6",
                                          "task.n_held_out=1", *wilcoxon))
    settings = StudySettings.from_config(compose_cfg(tmp_path, "search=tpe", "task.n_prompts=3"))
    assert settings.search["pruner"]["_target_"] == "tuner.search.pruners.PairedPruner"


@pytest.mark.parametrize("overrides,message", [
    (["search.pruner.margin=1.5"], "search.pruner: tuner.search.pruners.PairedPruner(margin=1.5, "
     "alpha=0.025, min_df=2) fails: margin=1.5: expected a fraction in [0, 1)"),
    (["~search.pruner", "+search.pruner={_target_:tuner.config.errors.ConfigError}"],
     "is not allowed: only Optuna classes ('optuna.') or this project's"),
])
def test_bad_pruner_settings_get_one_line(tmp_path, overrides, message):
    from tests.conftest import compose_cfg
    from tuner.study.settings import StudySettings
    with pytest.raises(ConfigError) as err:
        StudySettings.from_config(compose_cfg(tmp_path, "search=tpe", *overrides))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_resampled_tables_bound_its_false_prunes(tmp_path):
    """bench/pruner_resample.py on the committed per-prompt tables of the search benchmark
    (4 prompts per point, measured on the embedded default): at 3 prompts, a trial within 2 %
    of the best is pruned in at most 5 % of the draws (the stated (n − 1)·α), while trials
    clearly behind are pruned (Optuna's WilcoxonPruner(p_threshold=0.1) prunes none at 3
    prompts): measured on the three tables (4,000 draws each), 28 % of those at most 0.90x
    the best and 51 % of those at most 0.80x, with 0.7 % false prunes."""
    out = tmp_path / "resample.json"
    tables = sorted((ROOT / "bench").glob("results_search_*_cpu.json"))
    tables = [t for t in tables if any(p.get("per_prompt") for p in
                                       json.loads(t.read_text()).get("points", []))]
    assert tables, "no committed per-prompt tables"
    subprocess.run([sys.executable, str(ROOT / "bench" / "pruner_resample.py"), *map(str, tables),
                    "--draws", "600", "--json", str(out)], check=True, cwd=ROOT,
                   capture_output=True)
    every = json.loads(out.read_text())["all"]
    assert every["near_ties"] >= 50
    assert every["false_prune_rate"] <= 0.05, every
    assert every["power"] >= 0.10 and every["power_far"] >= 0.25, every
