"""A study's answer, once its trials are in: what to deploy, how sure, and why.

``finish``: the winner chosen, confirmed on held-out prompts, the best YAML written; ``decide``:
per concurrency level and request rate ON / OFF / NOT_CONFIRMED, and the recommendation;
``verdict``: the held-out figures' verdict lines; ``conclude``: every part gathered into one
frozen ``StudyOutcome`` (``outcome``: its types, and ``outcome.json`` written and read back);
``notes``: the summary's tables and lines; ``predicted``: predictions for another machine and
their calibration. The answer reads the study (``tuner.study``: settings, trials, records); the
study never imports the answer: ``tuner.run`` calls the finish after the optimize loop.
"""
