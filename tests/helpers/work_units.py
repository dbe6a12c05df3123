"""How `make test`'s parallel pass splits the suite between its two pytest-xdist workers
(``--dist loadgroup``): which test joins a group, and which tests start first.

It imports neither torch nor the tuner, so a test can run it in a small pytest session of its
own (tests/test_work_units.py) and check that xdist really keeps a group on one worker: with
pytest 9.2, pytest-xdist 3.8 ignores ``xdist_group`` (pytest-dev/pytest-xdist#1386), which is
why pyproject.toml keeps pytest below 9.2.
"""

from __future__ import annotations

import pytest

GROUPING_SCOPES = ("class", "module", "package")


def group_by_shared_fixtures(item: pytest.Item) -> None:
    """Put ``item`` in its module's ``xdist_group`` when it uses a class-, module- or
    package-scoped fixture, so that fixture is built once, on the worker that runs the module's
    users of it; any other test stays a work unit of its own."""
    # the fixtures' scopes: pytest has no public accessor for them
    if any(d.scope in GROUPING_SCOPES
           for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs):
        item.add_marker(pytest.mark.xdist_group(item.path.stem))


def slow_units_first(items: list[pytest.Item], first_modules: tuple[str, ...],
                     first_markers: tuple[str, ...]) -> None:
    """Sort ``items`` in place (stable): the modules of ``first_modules`` (in that order), then
    the tests marked with the first of ``first_markers``, then the next marker's, then the rest,
    so the long units start early and the two workers end together (a long unit taken last
    leaves the other worker idle: CI12 ended its parallel pass with ~100 s on one core)."""
    rank = {name: i for i, name in enumerate(first_modules)}

    def marker_rank(item: pytest.Item) -> int:
        return next((i for i, m in enumerate(first_markers) if item.get_closest_marker(m)),
                    len(first_markers))
    items.sort(key=lambda item: (rank.get(item.path.stem, len(rank)), marker_rank(item)))
