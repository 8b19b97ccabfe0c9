"""The size-1 group in process: every collective, the errors, init and launcher detection.

Fast (no launch): the same numpy-checked battery as the multi-rank tests, run on
``comm.LocalGroup()`` and on ``comm.init("local")``.
"""

from __future__ import annotations

import importlib
import sys
import time
from collections.abc import Callable
from types import ModuleType

import numpy as np
import pytest
import torch

import comm
from multiproc import rank_module

pytestmark = pytest.mark.timeout(60)

# Variables any launcher sets; cleared so "auto" sees a plain python process.
LAUNCH_VARS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
    "PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
    "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MPI_LOCALRANKID",
)  # fmt: skip


@pytest.fixture
def ranks_module() -> Callable[[str], ModuleType]:
    """Import a rank script as a module, by its full name (as they import each other)."""

    def load(name: str) -> ModuleType:
        return importlib.import_module(rank_module(name))

    return load


@pytest.fixture
def plain_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)


def test_battery_on_local_group(ranks_module: Callable[[str], ModuleType]) -> None:
    cases = ranks_module("comm_cases")
    group = comm.LocalGroup()
    n = cases.run_battery(group, seed=1234)
    assert n > 250
    assert group.validate is True  # the battery restores it


def test_battery_on_init_local(ranks_module: Callable[[str], ModuleType]) -> None:
    cases = ranks_module("comm_cases")
    with comm.init("local", timeout_s=5.0) as group:
        assert isinstance(group, comm.LocalGroup)
        assert (group.backend, group.rank, group.size, group.timeout_s) == ("local", 0, 1, 5.0)
        assert cases.run_battery(group, seed=7) > 250


def test_errors_on_local_group(ranks_module: Callable[[str], ModuleType]) -> None:
    errors = ranks_module("comm_errors")
    assert errors.run_errors(comm.LocalGroup()) >= 20


def test_init_auto_in_plain_process_is_local(plain_env: None) -> None:
    for group in (comm.init(), comm.init("auto"), comm.init("auto", validate=False)):
        assert isinstance(group, comm.LocalGroup) and group.backend == "local"
        assert (group.rank, group.size) == (0, 1)
    assert comm.init("auto", validate=False).validate is False
    assert comm.detect_launch().launcher == "none"


def test_detect_launch_from_env() -> None:
    mpich = comm.detect_launch({"PMI_RANK": "3", "PMI_SIZE": "4"})
    assert (mpich.launcher, mpich.rank, mpich.size) == ("mpirun", 3, 4)
    ompi = comm.detect_launch({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"})
    assert (ompi.launcher, ompi.rank, ompi.size) == ("mpirun", 1, 2)
    env = {"RANK": "2", "WORLD_SIZE": "3", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    tr = comm.detect_launch(env)
    assert (tr.launcher, tr.rank, tr.size) == ("torchrun", 2, 3)
    assert (tr.master_addr, tr.master_port) == ("10.0.0.1", 29500)
    assert comm.detect_launch({}).launcher == "none"
    # ranks on this host: what --sparse-pipeline auto divides the cores by
    assert (mpich.local_size, ompi.local_size, tr.local_size) == (1, 1, 1)
    hydra = comm.detect_launch({"PMI_RANK": "0", "PMI_SIZE": "4", "MPI_LOCALNRANKS": "4"})
    assert hydra.local_size == 4
    assert comm.detect_launch({**env, "LOCAL_WORLD_SIZE": "3"}).local_size == 3


def test_init_rejects_bad_arguments(plain_env: None) -> None:
    with pytest.raises(ValueError, match="unknown backend 'tcp'"):
        comm.init("tcp")
    with pytest.raises(ValueError, match="4 ranks"):
        comm.init("local", env={"PMI_RANK": "0", "PMI_SIZE": "4"})
    with pytest.raises(ValueError, match="timeout_s must be > 0 seconds, got 0"):
        comm.LocalGroup(timeout_s=0)
    with pytest.raises(ValueError, match=r"rank 1 of size 1"):
        comm.ProcessGroup.__init__(comm.LocalGroup(), 1, 1, timeout_s=1.0, validate=True)


def test_local_results_follow_the_contract() -> None:
    g = comm.LocalGroup()
    t = torch.tensor([1.5, -2.0])
    assert g.allreduce(t, "avg") is t and t.tolist() == [1.5, -2.0]  # in place
    assert g.broadcast(t) is t
    gathered = g.allgather(t)
    assert gathered.shape == (1, 2) and gathered.data_ptr() != t.data_ptr()
    rows = torch.arange(6.0).reshape(3, 2)
    out = g.alltoallv(rows, [3], [3])
    assert torch.equal(out, rows) and out.data_ptr() != rows.data_ptr()  # a fresh tensor
    out = g.reduce_scatter(rows, "sum")
    assert torch.equal(out, rows) and out.data_ptr() != rows.data_ptr()
    assert torch.equal(g.allgatherv(rows), rows)
    sub = g.split(3)
    assert isinstance(sub, comm.LocalGroup) and sub.size == 1
    h = g.allreduce_async(torch.ones(2))
    assert h.is_completed() and torch.equal(h.wait(), torch.ones(2))
    assert repr(g) == "LocalGroup(backend='local', rank=0, size=1)"


def test_handle_wait_times_out() -> None:
    """A handle whose operation never completes raises CommTimeoutError in time."""
    h = comm.Handle(lambda: False, lambda: None, what="fake recv", timeout_s=60.0)
    t0 = time.monotonic()
    with pytest.raises(comm.CommTimeoutError, match=r"fake recv did not complete within 0.2 s"):
        h.wait(timeout=0.2)
    assert time.monotonic() - t0 < 2.0
    assert issubclass(comm.CommTimeoutError, TimeoutError)


def test_handle_finishes_once() -> None:
    calls: list[int] = []
    state = {"done": False}

    def finish() -> np.ndarray:
        calls.append(1)
        return np.arange(3)

    h = comm.Handle(lambda: state["done"], finish, what="x", timeout_s=1.0)
    assert not h.is_completed()
    state["done"] = True
    first = h.wait()
    assert h.wait() is first and h.is_completed() and calls == [1]


def test_abort_in_a_lone_process_is_an_ordinary_exit(plain_env: None) -> None:
    # No MPI job and no torch.distributed group: abort is SystemExit with the code, so
    # finally blocks and atexit handlers still run.
    import torch.distributed as dist

    assert not dist.is_initialized()  # else abort would end this pytest process
    with pytest.raises(SystemExit) as exit_info:
        comm.abort(7)
    assert exit_info.value.code == 7
    with comm.init("local"), pytest.raises(SystemExit) as exit_info:
        comm.abort(0)
    assert exit_info.value.code == 0
    for bad in (-1, 256, 1.0, True, "2"):
        with pytest.raises(ValueError, match=rf"exit_code must be an int in 0..255, got {bad!r}"):
            comm.abort(bad)  # type: ignore[arg-type]


def test_abort_hook_installed_and_released_by_its_owner() -> None:
    failures = importlib.import_module("comm.failures")
    before = sys.excepthook
    owner, other = comm.LocalGroup(), comm.LocalGroup()
    failures.install_abort_hook(owner, 3)
    try:
        assert sys.excepthook is failures._abort_on_uncaught
        failures.release_abort_hook(other)  # not the owner: nothing changes
        assert sys.excepthook is failures._abort_on_uncaught
        try:
            raise RuntimeError("on the way out")
        except RuntimeError:
            # What a group's close() asks inside a finally that a failure passes through.
            assert failures.exception_in_flight()
        assert not failures.exception_in_flight()
        failures.release_abort_hook(owner)
        assert sys.excepthook is before
        # The abort hook prints the traceback itself over Python's default hook, and lets a
        # program's own hook print (torch's rank-prefixing wrapper is looked through in
        # the gloo launches of tests/comm/test_comm_failures.py).
        assert failures._programs_hook(sys.__excepthook__) is None

        def own(*args: object) -> None:
            pass

        assert failures._programs_hook(own) is own
    finally:
        sys.excepthook = before


def test_a_single_rank_group_installs_no_abort_hook(plain_env: None) -> None:
    before = sys.excepthook
    with comm.init("auto") as group:
        assert group.size == 1 and sys.excepthook is before


def test_running_job_is_none_in_a_lone_process() -> None:
    # The pytest process starts no MPI and no torch.distributed; the multi-rank answers
    # ("mpi", "torch") are what the failure tests' aborts rely on.
    assert comm.running_job() is None
