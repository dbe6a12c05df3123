"""How a configuration is measured: the evaluator protocol and its implementations, timing,
the lossless check, quality and energy. Knows nothing of Optuna or MLflow."""
