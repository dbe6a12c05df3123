"""A study as Optuna sees it: settings, storage, the point a trial holds, workers' liveness, the
objective and the optimize loop, the union of methods a pair and an engine support (the search's
planning is ``tuner.search``; the answer, once the trials are in, is ``tuner.answer``)."""
