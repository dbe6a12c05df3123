"""EAGLE draft-head training (``python -m eagle_training``): data from the tasks' non-held-out
records, target features, the training loop, a checkpoint in the published layout."""
