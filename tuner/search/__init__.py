"""What is searched and how: spaces from method YAMLs, the plans (heuristic, grid, predict),
objectives, racing and the pruner, and the search's planning beside its plans: claiming points
across workers (``points``), what trial 0 triggers (``ranking``: the profile's check,
``search=predict``'s ranking) and what a search costs (``cost``)."""
