"""A study as Optuna sees it: settings, storage, the points trials hold, the objective and the
optimize loop, and the finish step."""
