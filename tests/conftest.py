"""Shared pytest setup.

The tests live by package: ``tests/comm/``, ``ps/``, ``cache/``, ``embedding/``, ``dense/``,
``datasets/``, ``jobs/`` (the ``hybridrec`` jobs, trainer, checkpoints and planner) and
``project/`` (layering, docs, options reference, kernel sources); the helpers they share
are in ``tests/support/``. A multi-rank test's rank scripts are in the ``ranks/`` folder
beside it (``tests/dense/ranks/dense_dp.py``), found by name with
``multiproc.rank_script``.

Imports: ``pythonpath = [".", "tests/support"]`` in pyproject.toml puts the repository
root (the packages of this checkout, and ``benchmarks`` modules) and the helpers on
``sys.path``. Tests import the helpers by their bare module name, always: ``from
multiproc import run_ranks``, ``from redis_server import redis_server`` (never ``from
tests.support.multiproc import ...`` in a test: two names for one file would load it
twice). Rank scripts run in their own processes with the repository root on
``PYTHONPATH`` and import helpers and each other by full name
(``tests.support.tolerance``, ``tests.embedding.ranks.embedding_sharded``).

The default per-test timeout (300 s) is set in pyproject.toml; mark slower tests with
``@pytest.mark.timeout(N)``. ``--durations=15`` there prints the 15 slowest tests of
every run.
"""

from __future__ import annotations

import os
import shutil
import tempfile

# Every temporary file of the session, in this process and in every process a test starts,
# goes under one folder that the session removes at its end: torchrun keeps a log folder per
# launch in the temporary directory, which it never removes.
_SCRATCH = tempfile.mkdtemp(prefix="hybridrec-tests-")
os.environ["TMPDIR"] = tempfile.tempdir = _SCRATCH

# One torch thread in the pytest process and in every process a test starts (they inherit
# the environment), unless the caller chose otherwise: the tests' tensors are tiny, and
# with two threads per process on 2 shared cores an op of a few microseconds waits for the
# other thread (measured: a collection step 7x slower on a loaded machine).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from rank_battery import RankBattery  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session")
def rank_battery(tmp_path_factory: pytest.TempPathFactory) -> RankBattery:
    """The embedding and dense multi-rank checks, one launch per (backend, ranks)."""
    return RankBattery(tmp_path_factory.mktemp("rank_battery"))


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(_SCRATCH, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` skip, saying why, where torch sees no CUDA device."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA device; torch {torch.__version__} sees none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_report_header(config: pytest.Config) -> str:
    """The kernels ATen runs here: the numerics tests' verdicts are checked under each."""
    asked = os.environ.get("ATEN_CPU_CAPABILITY")
    got = torch.backends.cpu.get_cpu_capability()
    return f"ATen CPU capability: {got}" + (f" (ATEN_CPU_CAPABILITY={asked})" if asked else "")
