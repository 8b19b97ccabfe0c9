"""The cache's numpy paths forced, for tests that compare them with its C passes.

``cache.table_cache`` and ``cache.policy`` call each C pass through a function that
returns None (or False) where no kernel runs (no C compiler); replaced by a stand-in that
always says so, the cache takes the numpy path it takes on such a machine.
"""

from __future__ import annotations

import pytest

import cache.policy as policy
import cache.table_cache as table_cache

#: The C passes ``cache.table_cache`` and ``cache.policy`` call (their names for them).
TABLE_CACHE_KERNELS = (
    "copy_clocks", "sole_writer_asks", "plan_pull", "serve_rows", "pass_through",
    "install_rows", "update_rows", "evict_rows", "admit_rows",
)  # fmt: skip
POLICY_KERNELS = ("search_near", "pool_valid", "halve_keys")


def force_numpy_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every pass of :data:`TABLE_CACHE_KERNELS` and :data:`POLICY_KERNELS` on numpy (until
    ``monkeypatch`` undoes it)."""
    for name in TABLE_CACHE_KERNELS:
        monkeypatch.setattr(table_cache, name, lambda *a, **k: None)
    for name in POLICY_KERNELS:
        monkeypatch.setattr(policy, name, lambda *a, **k: None)
