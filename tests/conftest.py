"""Test tiers: every test is ``unit`` (tests/unit, in-process), ``multiproc`` (spawned ranks,
launcher runs, fault drills) or ``integration`` (tests/integration: users' scripts run as
users run them, under torchrun or ``phalanx train``); ``slow`` marks all but ``unit``.
``make test-fast`` runs ``unit and not slow``; ``make test`` runs everything, on two pytest
workers (pytest-xdist), the ``slow`` tests first so that neither worker is left with a long one
at the end."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        folder = Path(str(item.fspath)).parent.name
        tier = folder if folder in ("unit", "integration") else "multiproc"
        item.add_marker(getattr(pytest.mark, tier))
        if tier != "unit":
            item.add_marker(pytest.mark.slow)
    # The slow tests first (a stable sort: each part keeps its order)
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture
def fresh_world() -> Iterator[None]:
    """No world of one before the test or after it: ``phalanx.shutdown()`` both times (an
    Engine made without a context joins the implicit one). A module that needs it says
    ``pytestmark = pytest.mark.usefixtures("fresh_world")``."""
    import phalanx as px

    px.shutdown()
    yield
    px.shutdown()
