"""Shared pytest setup.

The repository root is on ``sys.path`` through ``pythonpath = ["."]`` in pyproject.toml, so
tests can import ``benchmarks`` modules as well as the installed packages.
The default per-test timeout (300 s) is set there too; mark slower tests with
``@pytest.mark.timeout(N)``.
"""

from __future__ import annotations

import pytest

from rank_battery import RankBattery


@pytest.fixture(scope="session")
def rank_battery(tmp_path_factory: pytest.TempPathFactory) -> RankBattery:
    """The embedding and dense multi-rank checks, one launch per (backend, ranks)."""
    return RankBattery(tmp_path_factory.mktemp("rank_battery"))
