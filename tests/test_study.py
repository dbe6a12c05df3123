"""Studies that say exactly what was measured, under which settings, against which baseline.

Every parameter reaches the method; a changed setting never resumes an old study; per-trial paired
baselines resist drift; workers sharing a study never duplicate a point; Ctrl-C and torn journals
are handled; small correctness fixes of a study (peak memory, decoding outside the timed window,
a truncated grid announced)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml
from optuna.trial import TrialState

from decoding import generate
from tests.conftest import ENV, SIDE_BY_SIDE, compose_cfg, load_study, run_study
from tests.helpers.services import sigint_default
from tuner.config.errors import ConfigError, StudyMismatch
from tuner.study.trials import failure_reason
from decoding.acceptance import AcceptanceCounts

TINY = ["models=tiny", "task.n_prompts=2", "task.n_held_out=1", "task.max_new_tokens=6",
        "warmup_prompts=1", *SIDE_BY_SIDE]
pytestmark = pytest.mark.usefixtures("in_tmp")
run = run_study


# -- every parameter reaches the method ---------------------------------------------------------


def test_an_ablation_switch_reaches_the_method_mlflow_and_the_best_yaml(tmp_path, monkeypatch):
    import mlflow

    from decoding.ouroboros import Ouroboros
    seen = []
    real = Ouroboros.__init__

    @functools.wraps(real)           # keeps the signature the validator reads
    def spy(self, *args, **kwargs):
        seen.append(kwargs["lengthen_drafts"])
        real(self, *args, **kwargs)

    monkeypatch.setattr(Ouroboros, "__init__", spy)
    result = run(tmp_path, "method=ouroboros", *TINY, "method.params.lengthen_drafts=false",
                 "method.params.window=8", "method.params.phrase_length=3",
                 "search=tpe", "search.n_trials=1", "tracking.experiment=abl")
    assert seen and set(seen) == {False}            # trial 0 and the held-out confirmation
    assert result["params"]["lengthen_drafts"] is False
    best = yaml.safe_load((tmp_path / "studies" / "best" / "t.yaml").read_text())
    assert best["method"]["params"]["lengthen_drafts"] is False
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    runs = mlflow.search_runs(experiment_names=["abl"], output_format="list")
    trial = next(r for r in runs if r.data.tags.get("kind") == "trial")
    assert trial.data.params["lengthen_drafts"] == "False"
    assert trial.data.params["num_phrases"] == "3"          # fixed (heuristic range of one value)
    parent = next(r for r in runs if r.data.tags.get("kind") == "study")
    assert parent.data.params["params.lengthen_drafts"] == "False"


def test_an_unknown_parameter_is_refused_before_models_load(tmp_path, monkeypatch):
    import tuner.engines.inprocess as hf
    monkeypatch.setattr(hf, "load_models", lambda *a, **k: pytest.fail("models loaded"))
    with pytest.raises(ConfigError, match=r"method.params.bogus=1 is not a parameter of "
                                          r"decoding.speculative.SpeculativeDecoding"):
        run(tmp_path, "method=speculative", *TINY, "+method.params.bogus=1")


def test_prompts_longer_than_the_context_are_refused_before_any_trial(tmp_path):
    """The tokenised prompts + max_new_tokens must fit the model: one line, no trial run."""
    with pytest.raises(ConfigError, match=r"task.max_new_tokens=6 does not fit the context of "
                                          r".*the longest prompt has \d+ tokens.*allowed is"):
        run(tmp_path, "method=speculative", *TINY, "models.target.max_position_embeddings=64",
            "tracking=none")
    assert load_study(tmp_path).trials[0].state == TrialState.WAITING     # trial 0 never ran


# -- study identity --------------------------------------------------------------------------


@pytest.mark.parametrize("change,key", [
    ("task.max_new_tokens=8", "budget.max_new_tokens"),
    ("sampling.temperature=0.7", "sampling"),
    ("models.target.seed=3", "models.target"),
    ("search=grid", "search"),
    ("baseline=per_study", "baseline"),
])
def test_changed_settings_never_resume_a_study(tmp_path, change, key, monkeypatch):
    run(tmp_path, "method=speculative", *TINY, "search=tpe", "search.n_trials=1",
        "tracking=none")
    import tuner.engines.inprocess as hf
    monkeypatch.setattr(hf, "load_models", lambda *a, **k: pytest.fail("models loaded"))
    with pytest.raises(StudyMismatch, match=rf"study 't' was measured under other settings "
                                            rf"\({key}: .*resume=force"):
        run(tmp_path, "method=speculative", *TINY, "search=tpe", "search.n_trials=1",
            "tracking=none", change)


def test_the_default_study_name_follows_the_settings(tmp_path):
    from tuner.study.settings import StudySettings
    names = [StudySettings.from_config(compose_cfg(tmp_path, "method=speculative", *TINY,
                                                   "study_name=null", *extra)).name
             for extra in ((), ("task.max_new_tokens=8",))]
    assert names[0] != names[1] and all(n.startswith("gsm8k-speculative-tiny-") for n in names)


def test_an_unchanged_config_keeps_its_recorded_fingerprint(tmp_path):
    """A study created before a code change resumes after it: the fingerprint of an unchanged
    config is the one recorded here (a changed hash orphans every existing study)."""
    from tuner.config.identity import short_hash
    from tuner.study.settings import StudySettings
    cfg = compose_cfg(tmp_path, base=("+task=gsm8k", "models=tiny", "method=speculative"))
    settings = StudySettings.from_config(cfg)
    assert "threads" not in settings.fingerprint           # threads=auto: not a key
    assert settings.name == f"gsm8k-speculative-tiny-{short_hash(settings.fingerprint)}"
    assert short_hash({k: v for k, v in settings.fingerprint.items() if k != "hardware"}) == \
        RECORDED_WITHOUT_HARDWARE
    if settings.fingerprint["hardware"] == '"cpu: AMD EPYC"':   # the machine it was recorded on
        assert settings.name == "gsm8k-speculative-tiny-168d329e"
    pinned = StudySettings.from_config(compose_cfg(tmp_path, "threads=1", base=(
        "+task=gsm8k", "models=tiny", "method=speculative")))
    assert pinned.fingerprint["threads"] == "1"            # an explicit count is part of it


# recorded with the code of 0e521a8 (before the study was split into settings, evaluator,
# objective and optimize loop); the hardware key (the CPU's model name) is left out so that the
# check holds on any machine; on the AMD EPYC it was recorded on the full name is checked too
RECORDED_WITHOUT_HARDWARE = "d86b0e47"


def test_an_unchanged_engine_config_keeps_its_recorded_fingerprint(tmp_path):
    """The same for an engine=llamacpp study (recorded before its engine became one object in
    tuner/engines/): the program's path and sha256 and the machine are left out, so the check
    holds on any machine; every other key, the engine's settings included, must be unchanged.
    Engine studies were made with objectives [speedup] then; the default [auto] now means
    [decode_speedup] for them, a new study by design, and nothing else differs."""
    from tuner.config.identity import differences, short_hash
    from tuner.study.settings import StudySettings
    base = ("+task=gsm8k", "models=smollm2", "method=prompt_lookup", "engine=llamacpp",
            "engine.binary=/bin/true", "budget.concurrency=[1,4]")
    settings = StudySettings.from_config(compose_cfg(tmp_path, "search.objectives=[speedup]",
                                                     base=base))
    now = StudySettings.from_config(compose_cfg(tmp_path, base=base))
    assert differences(settings.fingerprint, now.fingerprint) == ["search"]
    assert json.loads(now.fingerprint["search"])["objectives"] == ["decode_speedup"]
    kept = {k: v for k, v in settings.fingerprint.items() if k != "hardware"}
    engine = json.loads(kept["engine"])
    assert engine["kind"] == "llamacpp" and len(engine.pop("binary_sha256")) == 64
    assert engine.pop("binary") == "/bin/true"
    # since a batch of c > 1 requests goes as one request, levels above 1 say so (a journal
    # measured with c connections is not resumed as alike); the rest is as recorded
    assert engine.pop("batch") == "one request"
    kept["engine"] = json.dumps(engine, sort_keys=True)
    assert short_hash(kept) == RECORDED_LLAMACPP_WITHOUT_HARDWARE


# recorded with the code of 86647a6 (engines configured in tuner/config/engines.py) as
# "9240717e"; re-recorded when engine.baseline (matched) joined the engine's settings: a study
# made before measured against the plain llama-server and is not resumed against the matched one
RECORDED_LLAMACPP_WITHOUT_HARDWARE = "ea0154ea"


def test_resume_force_continues_a_changed_study(tmp_path):
    run(tmp_path, "method=speculative", *TINY, "search=tpe", "search.n_trials=1",
        "tracking=none")
    run(tmp_path, "method=speculative", *TINY, "search=tpe", "search.n_trials=2",
        "tracking=none", "warmup_prompts=0", "resume=force")
    assert len(load_study(tmp_path).get_trials(states=(TrialState.COMPLETE,))) == 2


# -- honest paired timing ----------------------------------------------------------------------


class DriftingClock:
    """Synthetic wall time: 1 ms per target forward + 0.4 ms per draft forward, times a factor
    that changes once after ``switch`` generations (a machine that got slower or faster)."""

    def __init__(self, switch: int, factor: float) -> None:
        self.switch, self.factor, self.calls = switch, factor, 0

    def __call__(self, method, ids, max_new_tokens, device):
        out = generate(method, ids, max_new_tokens)
        self.calls += 1
        scale = self.factor if self.calls > self.switch else 1.0
        # the first step planted too (1 ms, the prefill): the decode phase is the total less it,
        # and a real first step would let a loaded machine move the decode-phase figures
        planted = dataclasses.replace(out, stats=dataclasses.replace(out.stats,
                                                                    first_step_s=scale * 1e-3))
        return planted, scale * (out.stats.steps + 0.4 * out.stats.draft_forwards) * 1e-3


def _heuristic_study(tmp_path, name, baseline, clock):
    run(tmp_path, "method=speculative", "models=tiny", "task.n_prompts=2", "task.n_held_out=0",
        "task.max_new_tokens=16", "warmup_prompts=1", "search=heuristic", "tracking=none",
        f"baseline={baseline}", f"study_name={name}", timer=clock)
    study = load_study(tmp_path, name)
    done = study.get_trials(states=(TrialState.COMPLETE,))
    return {t.number: t.values[0] for t in done}, max(done, key=lambda t: t.values[0]).params


def test_a_slowdown_half_way_does_not_bias_the_choice_with_per_trial_baselines(tmp_path):
    # 1. the truth: no drift
    values, truth = _heuristic_study(tmp_path, "truth", "per_trial", DriftingClock(10**9, 1.0))
    best_trial = max(values, key=values.get)
    # 2. drift at a trial boundary that hurts the true best: slower from its trial on, or faster
    #    after trial 0 when trial 0 is the best (powers of two keep the ratios exact)
    per_trial_calls = 2 + 2 * 2              # warm-up (vanilla + method) + 2 prompts x (A + B)
    start, factor = (best_trial, 4.0) if best_trial > 0 else (1, 0.25)
    _, paired = _heuristic_study(tmp_path, "paired", "per_trial",
                                 DriftingClock(per_trial_calls * start, factor))
    assert paired == truth
    # 3. the same drift with one baseline per study picks another (wrong) configuration
    per_study_calls = 1 + 2                  # warm-up + 2 prompts of the method per trial
    _, stale = _heuristic_study(tmp_path, "stale", "per_study",
                                DriftingClock(3 + per_study_calls * start, factor))
    assert stale != truth


def test_speedup_is_per_generated_token():
    from tuner.measure.measurement import Measurement, paired_speedup
    vanilla = Measurement("p", "", (1,) * 10, "", 1.0, AcceptanceCounts(steps=10), 0.0, 0.0)
    shorter = Measurement("p", "", (2,) * 4, "", 0.5,
                          AcceptanceCounts(steps=2, drafted=4, accepted=2), 0.0, 0.0)
    # the method stopped after 4 tokens in half the time: 0.125 s/token vs 0.1 -> slower
    assert paired_speedup(vanilla, shorter) == pytest.approx(0.8)


def test_text_is_decoded_outside_the_timed_window(tmp_path):
    from tuner.engines.inprocess import HFEvaluator
    from tuner.study.settings import StudySettings
    seen = []

    def timer(method, ids, max_new_tokens, device):
        out = generate(method, ids, max_new_tokens)
        seen.append(out.text)
        return out, 1.0

    settings = StudySettings.from_config(compose_cfg(tmp_path, *TINY, "warmup_prompts=0"))
    evaluator = HFEvaluator(settings.measuring, timer)
    evaluator.open()
    pair, = evaluator.measure(settings.default, [(0, settings.tuning[0])], parity=1)
    assert seen == [None, None]                  # vanilla and the method: ids only in the window
    assert len(pair.method.text) > 0 and pair.method.truncated


def test_the_contention_window_is_the_one_each_pair_samples(tmp_path):
    """contention_window_s reaches the guard: each measured pair's load sample lasts that long
    (its ``sampler`` records the windows it is asked for; nothing is slept)."""
    from tuner.engines.inprocess import HFEvaluator
    from tuner.measure.hygiene import LoadSample
    from tuner.measure.timing import time_generation
    from tuner.study.settings import StudySettings
    windows = []

    def sampler(cpus, window_s):
        windows.append(window_s)
        return LoadSample(0.0, 0.0, window_s, tuple(cpus))

    settings = StudySettings.from_config(compose_cfg(tmp_path, *TINY, "warmup_prompts=0",
                                                     "contention_window_s=0.07"))
    evaluator = HFEvaluator(settings.measuring, time_generation)
    evaluator.open()
    evaluator.guard = dataclasses.replace(evaluator.guard, sampler=sampler)
    list(evaluator.measure(settings.default, list(enumerate(settings.tuning)), parity=0))
    assert windows == [0.07, 0.07]                # the two tuning prompts' pairs


def test_peak_memory_is_reset_per_window():
    # a fresh process: in this one the test suite's own memory hides a 256 MiB peak
    code = """
import torch
from tuner.measure.timing import peak_memory_bytes, reset_peak_memory
cpu = torch.device("cpu")
big = torch.ones(256 * 1024 * 1024 // 4)
del big
before = peak_memory_bytes(cpu)
reset_peak_memory(cpu)
after = peak_memory_bytes(cpu)
assert after < before - 128 * 1024 * 1024, (before, after)
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=ENV, timeout=120)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-1000:]


# -- concurrency and interruption ----------------------------------------------------------------


@pytest.mark.slow
def test_two_workers_on_one_journal_never_duplicate_a_point(tmp_path):
    args = [sys.executable, "-m", "tuner", "+task=gsm8k", "method=speculative", *TINY,
            "search=grid", "search.ranges=full", "method.space.num_draft_tokens.high=5",
            "method.params.num_draft_tokens=2", "study_name=shared", "tracking.experiment=two"]
    workers = [subprocess.Popen(args, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [w.communicate(timeout=600)[0] for w in workers]
    assert all(w.returncode == 0 for w in workers), "\n".join(o[-1500:] for o in outputs)
    study = load_study(tmp_path, "shared")
    complete = [t.params["num_draft_tokens"] for t in study.get_trials(
        states=(TrialState.COMPLETE,))]
    assert sorted(complete) == [1, 2, 3, 4, 5]               # every planned point exactly once
    assert [t.user_attrs.get("stage") for t in study.trials].count("default") == 1
    assert study.trials[0].params == {"num_draft_tokens": 2}
    assert all(failure_reason(study, t).startswith("duplicate")
               for t in study.get_trials(states=(TrialState.FAIL,)))
    # both workers reach the finish step: one writes the result, the other says where it is
    assert sum("best configuration written to" in o for o in outputs) == 1, outputs
    assert sum("is already finished with these 5 trials" in o for o in outputs) == 1, outputs
    import mlflow
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    runs = mlflow.search_runs(experiment_names=["two"], output_format="list")
    parents = [r for r in runs if r.data.tags.get("kind") == "study"]
    assert len(parents) == 1                                  # one parent, both workers' trials
    trial_runs = [r for r in runs if r.data.tags.get("kind") == "trial"
                  and r.data.tags.get("state") == "COMPLETE"]
    assert len(trial_runs) == 5 and all(r.data.tags["mlflow.parentRunId"] ==
                                        parents[0].info.run_id for r in trial_runs)


@pytest.mark.slow
def test_ctrl_c_fails_the_trial_kills_the_runs_and_the_rerun_finishes(tmp_path):
    args = [sys.executable, "-m", "tuner", "+task=gsm8k", "method=speculative", "models=tiny",
            "task.n_prompts=2", "task.n_held_out=1", "task.max_new_tokens=48", "search=grid",
            "search.ranges=full", "method.space.num_draft_tokens.high=3",
            "method.params.num_draft_tokens=1", "study_name=c", "tracking.experiment=cc",
            *SIDE_BY_SIDE]
    log = open(tmp_path / "first.log", "w")
    proc = subprocess.Popen(args, cwd=tmp_path, env=ENV, stdout=log, stderr=subprocess.PIPE,
                            text=True, preexec_fn=sigint_default)
    deadline = time.monotonic() + 300
    while "trial 1 prompt 1/" not in (tmp_path / "first.log").read_text():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "re-run the same command to resume" in lines[0].lower(), stderr
    study = load_study(tmp_path, "c")
    failed = study.get_trials(states=(TrialState.FAIL,))
    assert len(failed) == 1 and failure_reason(study, failed[0]).startswith("interrupted")
    import mlflow
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    runs = mlflow.search_runs(experiment_names=["cc"], output_format="list")
    status = {r.data.tags.get("mlflow.runName"): r.info.status for r in runs}
    assert status["trial-1"] == "KILLED" and status["c"] == "KILLED", status
    rerun = subprocess.run(args, cwd=tmp_path, env=ENV, capture_output=True, text=True,
                           timeout=600)
    assert rerun.returncode == 0, rerun.stdout[-1500:] + rerun.stderr[-1500:]
    study = load_study(tmp_path, "c")
    assert sorted(t.params["num_draft_tokens"] for t in study.get_trials(
        states=(TrialState.COMPLETE,))) == [1, 2, 3]
    runs = mlflow.search_runs(experiment_names=["cc"], output_format="list")
    parent = next(r for r in runs if r.data.tags.get("kind") == "study")
    assert parent.info.status == "FINISHED"


def test_a_torn_journal_is_reported_and_left_untouched(tmp_path):
    run(tmp_path, "method=speculative", *TINY, "search=tpe", "search.n_trials=1",
        "tracking=none")
    journal = tmp_path / "studies" / "t.journal"
    torn = journal.read_bytes() + b'{"op_code": 5, "worker_id": "x", "trial_id'
    journal.write_bytes(torn)
    with pytest.raises(ConfigError, match=rf"study journal {journal} ends in an incomplete line"
                                          r".*nothing was changed"):
        run(tmp_path, "method=speculative", *TINY, "search=tpe", "search.n_trials=2",
            "tracking=none")
    assert journal.read_bytes() == torn


def test_an_orphan_check_does_not_trust_its_own_pid():
    import socket

    from optuna.trial import create_trial

    from tuner.study.liveness import RUN_TOKEN, gone
    mine = {"host": socket.gethostname(), "pid": os.getpid()}
    earlier = create_trial(state=TrialState.RUNNING, user_attrs={**mine, "run_token": "old"})
    current = create_trial(state=TrialState.RUNNING, user_attrs={**mine, "run_token": RUN_TOKEN})
    assert gone(earlier) and gone(current) is None


def test_a_trial_being_stamped_is_not_reaped():
    """Found by tests/test_stress.py on PostgreSQL: a reaper saw trial 0 with its worker's host
    but not yet its pid (stamped one attribute at a time), judged pid -1 dead and failed the trial
    under its live worker. A trial with no pid yet is not judged; a dead pid still is."""
    import socket

    from optuna.trial import create_trial

    from tuner.study.liveness import gone
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    half = create_trial(state=TrialState.RUNNING, user_attrs={"host": socket.gethostname()})
    ended = create_trial(state=TrialState.RUNNING,
                         user_attrs={"host": socket.gethostname(), "pid": dead.pid})
    assert gone(half) is None and "ended before it finished" in gone(ended)


def test_a_slurm_trial_is_judged_by_the_job_check_it_is_given():
    """The study never imports the Slurm layer: whether a trial's Slurm job is alive is asked
    through the ``job_alive`` it is handed (None: no answer, never death); without one, only a
    heartbeat can reap it. ``reap`` fails and re-queues it like any dead worker's trial."""
    import optuna
    from optuna.trial import create_trial

    from tuner.study.liveness import gone, orphans, reap
    slurm_trial = create_trial(state=TrialState.RUNNING, user_attrs={"slurm_job_id": "12_3"})
    asked = []
    assert gone(slurm_trial) is None
    assert gone(slurm_trial, lambda job: asked.append(job)) is None and asked == ["12_3"]
    assert gone(slurm_trial, lambda job: True) is None
    assert gone(slurm_trial, lambda job: False) == "Slurm job 12_3 is gone"
    study = optuna.create_study()
    trial = study.ask()
    trial.suggest_int("k", 1, 8)
    trial.set_user_attr("slurm_job_id", "12_3")
    assert reap(study) == [] and reap(study, job_alive=lambda job: None) == []
    assert reap(study, job_alive=lambda job: False) == [0] and orphans(study) == {0}
    retry = study.get_trials()[1]
    assert retry.state == TrialState.WAITING and retry.user_attrs["retry_of"] == 0


# -- small correctness fixes ------------------------------------------------------------------


def test_a_truncated_grid_is_announced(tmp_path, capsys):
    run(tmp_path, "method=speculative", *TINY, "search=grid", "search.ranges=full",
        "method.space.num_draft_tokens.high=5", "method.params.num_draft_tokens=1",
        "search.n_trials=2", "tracking=none")
    assert "search.n_trials=2 truncates the full grid of 5 points: 3 points will not be " \
           "evaluated" in capsys.readouterr().out


def test_prepare_work_finish_phases(tmp_path, monkeypatch):
    import tuner.engines.inprocess as run_module
    common = ["method=speculative", *TINY, "search=grid", "search.ranges=full",
              "method.space.num_draft_tokens.high=3", "method.params.num_draft_tokens=2",
              "tracking.experiment=ph"]
    real_load = run_module.load_models
    monkeypatch.setattr(run_module, "load_models", lambda *a, **k: pytest.fail("models loaded"))
    prepared = run(tmp_path, *common, "phase=prepare")
    assert prepared["created"] is True
    study = load_study(tmp_path)
    assert [t.state for t in study.trials] == [TrialState.WAITING]
    assert study.user_attrs["mlflow_parent_run_id"] and study.user_attrs["fingerprint"]
    assert run(tmp_path, *common, "phase=prepare")["created"] is False    # idempotent
    assert len(load_study(tmp_path).trials) == 1
    monkeypatch.setattr(run_module, "load_models", real_load)
    run(tmp_path, *common, "phase=work")
    assert not (tmp_path / "studies" / "best").exists()
    done = load_study(tmp_path).get_trials(states=(TrialState.COMPLETE,))
    assert sorted(t.params["num_draft_tokens"] for t in done) == [1, 2, 3]
    result = run(tmp_path, *common, "phase=finish")
    best = tmp_path / "studies" / "best" / "t.yaml"
    assert best.is_file()
    assert len(load_study(tmp_path).trials) == 3 and result["trial"] in (0, 1, 2)
    written = best.read_bytes()
    again = run(tmp_path, *common, "phase=finish")         # nothing new: not measured again
    assert again.get("finished_elsewhere") is True and best.read_bytes() == written
    assert not (tmp_path / "studies" / "best" / "t.finish.lock").exists()


def test_a_scheduled_rerun_says_what_changed_since_the_previous_run(tmp_path):
    from dataclasses import replace

    from omegaconf import OmegaConf

    from tuner.answer.conclude import replay_body
    from tuner.answer.notes import compare_previous
    from tuner.study.settings import StudySettings
    folder = tmp_path / "best"
    settings = replace(StudySettings.from_config(compose_cfg(tmp_path, *TINY)),
                       name="fam-20261120")
    header, body = replay_body(settings, params={"num_draft_tokens": 4},
                               best={"trial": 0, "value": 1.2},
                               confirmed={"held_out_speedup": 1.25})
    folder.mkdir()
    (folder / "fam-20261120.yaml").write_text(header + OmegaConf.to_yaml(body))
    assert compare_previous(folder, "fam", "fam-20261120", {"num_draft_tokens": 4}, {}) is None
    same = compare_previous(folder, "fam", "fam-20261121", {"num_draft_tokens": 4},
                            {"held_out_speedup": 1.0})
    assert same == ("since fam-20261120: best parameters unchanged; held-out speedup 1.250x -> "
                    "1.000x (-20.0 %)")
    moved = compare_previous(folder, "fam", "fam-20261121", {"num_draft_tokens": 6},
                             {"held_out_speedup": 1.3})
    assert moved.startswith("since fam-20261120: best parameters changed: num_draft_tokens 4 -> 6")
