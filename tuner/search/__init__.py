"""What is searched and how: spaces from method YAMLs, the heuristic and grid plans, objectives."""
