"""From a composed Hydra config to checked settings: validation, the study fingerprint, building
methods and models. Nothing here measures anything."""
