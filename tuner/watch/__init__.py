"""``python -m tuner.watch``: a running deployment's acceptance, watched against the study it
came from (``__main__``). Scrapes → windows (``source``, ``windows``) → the change test (``drift``)
→ the decision by acceptance × cost at the live batch (``decide``) → the record (``record``); the
study read from its ``outcome.json`` and best YAML (``study``); the loop (``loop``)."""
