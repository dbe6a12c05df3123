"""Slurm fan-out of a study. It sits above ``tuner.study`` (which never imports it); worker
liveness (heartbeats, reaping dead workers) is ``tuner.study.liveness``."""
