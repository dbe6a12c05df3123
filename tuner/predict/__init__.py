"""Acceptance × cost: predicted speculative speed.

``surface``: cost surfaces and versioned hardware profiles (JSON); ``loops``: our own loops'
surface measured on this machine (``python -m tuner.profile``); ``roofline``: estimated surfaces
from a model's shapes and a machine's bandwidth and throughput (``--roofline``); ``synthetic``:
an engine server's surface from its synthetic-acceptance mode (``--engine``); ``check``: whether
a profile is believed (its fit when made, vanilla's price in every study); ``trace``: acceptance
from one untimed, traced generation (methods that do not replay); ``predict``: a replayed
acceptance (``decoding.replay``) or a traced one priced by a surface, against vanilla on the same
surface, and the calibration of predictions against measurements; ``served``: an engine server's
decode-phase speedup per concurrency level from its own surface; ``schedule``: a per-batch-size
schedule of drafted tokens (the best k per level, thresholds between levels); ``forms``: that
schedule in the form each engine loads.
"""
