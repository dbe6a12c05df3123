"""Every decoding method's config, as the conformance tests see it (tests/test_methods.py,
tests/test_compiled.py, tests/test_reserved_cache.py).

``CONFIGS``: each ``conf/method/*.yaml`` with its interpolations resolved as under ``models=tiny``;
``ALL``: their names; ``method(name, pair, **kw)``: the method built on its YAML defaults, ``kw``
winning; ``PROMPTS``: the shared greedy prompts (short, repeated and out-of-order tokens).
"""

from __future__ import annotations

from pathlib import Path

import yaml
from omegaconf import OmegaConf

from decoding import build_method

CONF = Path(__file__).resolve().parents[2] / "conf" / "method"
TINY_MODELS = yaml.safe_load((CONF.parent / "models" / "tiny.yaml").read_text())


def resolved(path: Path) -> dict:
    """A method YAML with its interpolations resolved as under ``models=tiny`` (EAGLE's head)."""
    cfg = OmegaConf.create({"models": TINY_MODELS, "method": yaml.safe_load(path.read_text())})
    return OmegaConf.to_container(cfg, resolve=True)["method"]


CONFIGS = {p.stem: resolved(p) for p in sorted(CONF.glob("*.yaml"))
           if p.stem != "auto"}     # method=auto: a union of these (tests/test_across.py)
DEFAULTS = {name: cfg["params"] for name, cfg in CONFIGS.items()}
ALL = sorted(DEFAULTS)
PROMPTS = [list(range(3, 3 + n)) for n in (1, 2, 5, 9)] + [[7, 7, 7, 7, 7, 7], [200, 13, 99]]


def method(name, pair, **kw):
    return build_method(name, pair, **{**DEFAULTS[name], **kw})
