"""What a study reports: MLflow callbacks, the MLflow server for many writers, the summary."""
