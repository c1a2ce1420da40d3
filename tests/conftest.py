"""Test tiers: every test is ``unit`` (tests/unit, in-process) or ``multiproc`` (spawned ranks,
launcher runs, fault drills); ``slow`` marks the ones that spawn processes or train for real.
``make test-fast`` runs ``unit and not slow``; ``make test`` runs everything."""

from __future__ import annotations

from pathlib import Path

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tier = "unit" if Path(str(item.fspath)).parent.name == "unit" else "multiproc"
        item.add_marker(getattr(pytest.mark, tier))
        if tier == "multiproc":
            item.add_marker(pytest.mark.slow)
