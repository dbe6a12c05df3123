"""Acceptance × cost: predicted speculative speed.

``surface``: cost surfaces and versioned hardware profiles (JSON); ``loops``: our own loops'
surface measured on this machine (``python -m tuner.profile``); ``predict``: a replayed
acceptance (``decoding.replay``) priced by a surface, against vanilla on the same surface, and
the calibration of predictions against measurements.
"""
