"""A study as Optuna sees it: settings, storage, the points trials hold, the objective and the
optimize loop (the answer, once the trials are in, is ``tuner.answer``)."""
