"""``search.profile=auto`` (tuner.predict.cache): a study that ranks by prediction and has no
profile makes one on first use, says so with its time, caches it per machine, models, engine,
threads and build, and a second study reuses it; a profile flagged when made, or failing its
check against trial 0, is made again once, then refused in one line."""

from __future__ import annotations

import re

import pytest

from tuner.config.errors import ConfigError

STUDY = ["models=tiny", "method=speculative", "task.n_prompts=2", "task.n_held_out=1",
         "task.max_new_tokens=16", "search=predict", "search.ranges=full",
         "method.space.num_draft_tokens.high=3", "method.params.num_draft_tokens=2",
         "search.top=1", "search.spread=0", "search.race=null", "search.profile_rounds=1",
         "tracking=none"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "profiles"
    monkeypatch.setenv("SPECTUNE_PROFILES", str(folder))
    return folder


def test_a_study_makes_its_profile_on_first_use_and_the_next_reuses_it(tmp_path, monkeypatch,
                                                                      capsys, cache):
    from tests.conftest import load_study, run_study
    from tuner.predict.cache import PROFILE_USED
    monkeypatch.chdir(tmp_path)
    run_study(tmp_path, *STUDY, "study_name=first")
    out = capsys.readouterr().out
    assert "search.profile=auto: no profile of these models here yet" in out
    made = re.search(r"search\.profile=auto: made in \d+ s, cached at (\S+)", out)
    assert made, out[-2000:]
    [path] = list(cache.glob("*.json"))
    assert str(path) == made.group(1)
    assert "search=predict: predicting 3 points" in out
    record = load_study(tmp_path, "first").user_attrs[PROFILE_USED]
    assert record["made_now"] is True and record["path"] == str(path)
    stamp = path.stat().st_mtime_ns

    run_study(tmp_path, *STUDY, "study_name=second")
    out = capsys.readouterr().out
    assert "making one now" not in out and f"search.profile=auto: {path} (made " in out
    assert path.stat().st_mtime_ns == stamp and list(cache.glob("*.json")) == [path]
    second = load_study(tmp_path, "second")
    assert second.user_attrs[PROFILE_USED]["made_now"] is False
    assert all(t.user_attrs["predicted_speedup"] > 0 for t in second.get_trials()
               if t.state.name == "COMPLETE")


def test_a_cached_profile_of_other_threads_or_models_is_not_used(cache):
    """The key holds the machine, the models, the threads and the build: a cached file made for
    another thread count is a miss (made again), as is one whose content says other models."""
    from tuner.predict.cache import Key, cached
    models = {"target": {"kind": "tiny", "seed": 0}, "draft": {"kind": "early_exit",
                                                               "num_layers": 1}}
    one, two = Key.here(models, "hf", 1), Key.here(models, "hf", 2)
    assert one.path() != two.path()
    other = Key.here({**models, "draft": None}, "hf", 1)
    assert other.path() != one.path()
    assert cached(one) is None                   # nothing cached yet
    one.path().parent.mkdir(parents=True)
    one.path().write_text("{not json")
    assert cached(one) is None                   # a torn file is a miss, not a traceback


def test_a_flagged_profile_is_made_again_once_then_refused(tmp_path, cache):
    """A profile whose fit is flagged when made is made once more; flagged again, refused in one
    line with nothing cached; clean the second time, cached."""
    from dataclasses import replace

    from tuner.predict.cache import obtain
    from tuner.predict.surface import load_profile
    clean = load_profile(str(tiny_profile_file(tmp_path / "clean.json")))
    flagged = replace(clean, flags=("other processes used 40% of the CPUs during round 2",))
    models = {"target": {"kind": "tiny", "seed": 0}, "draft": None}
    made, lines = [], []

    def always_flagged(models, engine, threads, repeats, say):
        made.append(repeats)
        return flagged
    with pytest.raises(ConfigError) as err:
        obtain(models, "hf", 1, lines.append, repeats=2, measure=always_flagged)
    assert made == [2, 2] and "\n" not in str(err.value)
    assert "search.profile=auto: the profile made here was flagged twice" in str(err.value)
    assert any("making it again once" in line for line in lines)
    assert not list(cache.glob("*.json"))        # nothing cached

    def flagged_then_clean(models, engine, threads, repeats, say):
        made.append(repeats)
        return flagged if len(made) == 3 else clean
    got = obtain(models, "hf", 1, lines.append, repeats=2,
                 measure=flagged_then_clean)
    assert got.made_now and got.path.is_file() and not got.profile.flags and len(made) == 4


def tiny_profile_file(path):
    from tuner import profile as cli
    assert cli.main(["--models", "tiny", "--repeats", "1", "--contexts", "8", "128", "--rows",
                     "1", "4", "--draft-rows", "1", "2", "--out", str(path)]) == 0
    return path


def test_a_failed_check_against_trial_0_remakes_the_profile_once(tmp_path, monkeypatch, capsys,
                                                                 cache):
    """The check (tuner.predict.check.vanilla_check) is made to read the profile 2x off every
    time: trial 0's reading is measured again once, the profile is made again once, checked
    again (measured beside its forwards), and search=predict stops after trial 0 in one line."""
    from dataclasses import replace

    from tests.conftest import run_study
    from tuner.predict import check
    real = check.vanilla_check
    checked = []

    def twice_off(profile, runs):
        got = real(profile, runs)
        checked.append(profile.made)
        return replace(got, measured=2 * got.priced, seconds=max(got.seconds, 60.0))
    monkeypatch.setattr(check, "vanilla_check", twice_off)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        run_study(tmp_path, *STUDY, "study_name=remade")
    out = capsys.readouterr().out
    assert len(checked) == 3 and out.count("making one now") == 2, out[-3000:]
    assert checked[0] == checked[1] != checked[2]         # confirmed, then the remade one
    assert out.count("measuring vanilla again beside its 1-row forwards, once") == 1
    assert ": making the profile again, once" in out
    assert "search=predict stops after trial 0" in str(err.value)
    assert "(made again once already)" in str(err.value) and "\n" not in str(err.value)


def test_an_engine_server_has_no_auto_profile_and_gets_one_line():
    from tuner.engines import engine_named
    from tuner.study.settings import auto_profile
    with pytest.raises(ConfigError) as err:
        auto_profile(engine_named("vllm"), {"target": {"kind": "tiny"}}, "auto")
    assert str(err.value).startswith("search.profile=auto is invalid for engine=vllm: a profile "
                                     "is made here on first use for our own loops only")
    assert "python -m tuner.profile --engine vllm" in str(err.value)
    assert "\n" not in str(err.value)
