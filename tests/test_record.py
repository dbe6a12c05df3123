"""``tuner.study.record.TrialRecord``: written onto a trial in one place, read back the same, and
reading what studies recorded before it existed."""

from __future__ import annotations

import optuna

from tuner.study.record import FIGURES, TrialRecord


def _study() -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(direction="maximize")


def test_a_record_round_trips_through_a_trial():
    study = _study()
    trial = study.ask()
    summary = {"speedup": 1.2, "throughput_ratio@c4": 0.9, "tokens_per_s@c4": 11.0,
               "wall_s": 3.0, "quality_accuracy": 1.0}          # the last two are not kept
    written = TrialRecord.from_summary(summary, feasible=False,
                                       constraints={"quality_drop": 0.5}, vanilla_drift=True,
                                       contended=True, compiled="buckets [1, 2]")
    written.write(trial)
    study.tell(trial, 1.2)
    read = TrialRecord.read(study.trials[0])
    assert read == written
    assert dict(read.figures) == {"speedup": 1.2, "throughput_ratio@c4": 0.9,
                                  "tokens_per_s@c4": 11.0}
    assert read.infeasible and read.at_level("throughput_ratio", 4) == 0.9
    assert read.at_level("throughput_ratio", 1) is None


def test_unset_flags_are_not_written_so_an_old_trial_reads_the_same():
    """A record with no bound, no drift and no contention writes only its figures (the keys an
    older study's trials have), and a trial with only those keys reads back as such a record."""
    study = _study()
    trial = study.ask()
    TrialRecord.from_summary({"speedup": 0.8, "engine_varies": 2.0}).write(trial)
    study.tell(trial, 0.8)
    frozen = study.trials[0]
    assert set(frozen.user_attrs) == {"speedup", "engine_varies"}
    read = TrialRecord.read(frozen)
    assert read.feasible is None and not read.infeasible and not read.contended
    assert read.engine_varies and read.pruned_at is None


def test_the_recorded_keys_are_those_of_earlier_studies():
    """Renaming a kept key would orphan what every existing study recorded."""
    assert {"speedup", "throughput_ratio", "contended_prompts", "engine_varies",
            "vanilla_drift_ratio", "quality_drop"} <= set(FIGURES)
    study = _study()
    trial = study.ask()
    for key, value in {"feasible": True, "constraints": {"perplexity_ratio": -0.1},
                       "contended": True, "pruned_at": 3, "speedup": 1.0}.items():
        trial.set_user_attr(key, value)                  # as the objective wrote them before
    study.tell(trial, 1.0)
    read = TrialRecord.read(study.trials[0])
    assert read.feasible is True and read.contended and read.pruned_at == 3
    assert read.constraints == {"perplexity_ratio": -0.1}
