"""Shared helpers of the test suite: what more than one test module needs lives here, never in a
``test_*.py`` module (no test module imports another: tests/test_layout.py checks it).

- ``laws``: exact two-token laws of a target and the chi-square test of sampled pairs.
- ``toy``: toy next-token models for exact enumeration of verification laws.
- ``services``: skip-or-fail guards for the real Slurm, PostgreSQL, llama-server and vLLM.
- ``methods``: every method's YAML config resolved under ``models=tiny``, ``method()`` and the
  shared greedy prompts.
- ``eagle``: the oracle EAGLE head (the target answering as the head) and its prompt.

The stress harness (K workers on one study) is not here: ``bench/stress.py`` holds it, so that
``bench/stress_workers.py`` imports no test code.
"""
