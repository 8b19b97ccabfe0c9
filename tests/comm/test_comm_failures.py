"""One failing rank ends the whole job in seconds, under every launcher, with the rank named.

Each launch runs ``tests/comm/ranks/fail_one_rank.py``: every rank joins the group (default
300 s timeout), then one rank raises an uncaught exception, kills itself with SIGKILL,
or calls ``comm.abort(3)``, while the others block in an allreduce that needs it. The
job must end less than ``LIMIT_S`` after the moment the failing rank printed, with a
non-zero exit, and the output must name the failing rank (its labelled traceback for an
exception; torchrun's summary for a kill, since MPICH's launcher names no rank).
One launch per (launcher, backend, ranks, failure).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from multiproc import ROOT, free_port, mpirun_path, rank_env, rank_script

LIMIT_S = 10.0  # from the failure to the launcher's exit; without the hook: the 300 s timeout
LAUNCHES = (("mpirun", "mpi"), ("mpirun", "gloo"), ("torchrun", "gloo"))
# Which rank fails: not always the last one, and at 4 ranks a kill takes rank 0 (under
# mpirun with gloo it hosts the rendezvous store).
FAILING = {("raise", 2): 1, ("kill", 2): 1, ("raise", 4): 2, ("kill", 4): 0, ("abort", 2): 1}


def _launch(launcher: str, backend: str, nprocs: int, args: list[str]) -> tuple[int, str, float]:
    """Run the job to its end; (exit code, all output, time.time() when it ended)."""
    script = str(rank_script("fail_one_rank.py"))
    if launcher == "mpirun":
        cmd = [mpirun_path(), "-n", str(nprocs), sys.executable, script, *args]
    else:
        torchrun = str(Path(sys.executable).parent / "torchrun")
        port = str(free_port())
        cmd = [torchrun, "--nproc_per_node", str(nprocs), "--master-port", port, script, *args]
    env = rank_env()
    env["HYBRIDREC_TEST_BACKEND"] = backend
    proc = subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # so a hang can be killed with every rank
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=100)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out = proc.communicate()[0]
        raise AssertionError(f"{' '.join(cmd)}: still running after 100 s\n{out}") from None
    return proc.returncode, out, time.time()


def _check_ended_in_time(mode: str, rank: int, code: int, out: str, ended: float) -> None:
    assert code != 0, f"exit code 0 after a failure:\n{out}"
    failed_at = re.search(rf"rank {rank}: failing now \({mode}\) at ([0-9.]+)", out)
    assert failed_at is not None, out
    took = ended - float(failed_at.group(1))
    assert took < LIMIT_S, f"the job ended {took:.1f} s after the failure:\n{out}"
    assert ": done (" not in out, out  # no rank got past the collective the failed rank left
    print(f"ended {took:.2f} s after the failure")  # shown with pytest -s


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ("raise", "kill"))
@pytest.mark.parametrize("nprocs", (2, 4))
@pytest.mark.parametrize(("launcher", "backend"), LAUNCHES)
def test_one_failing_rank_ends_the_job(launcher: str, backend: str, nprocs: int, mode: str) -> None:
    rank = FAILING[(mode, nprocs)]
    code, out, ended = _launch(launcher, backend, nprocs, [mode, str(rank)])
    _check_ended_in_time(mode, rank, code, out, ended)
    if mode == "raise":
        # The hook's labelled traceback, every line prefixed with the rank.
        assert f"[rank {rank}] uncaught RuntimeError: ending the whole job" in out, out
        assert f"[rank {rank}] Traceback (most recent call last):" in out, out
        assert f"[rank {rank}] RuntimeError: injected failure on rank {rank}" in out, out
    elif launcher == "torchrun":
        # torchrun's failure summary pairs the rank with its signal.
        assert re.search(rf"rank\s*: {rank} \(local_rank: {rank}\)\s*exitcode\s*: -9", out), out
    else:
        assert "Killed (signal 9)" in out or "Connection closed by peer" in out, out


@pytest.mark.timeout(120)
def test_comm_abort_ends_the_job_with_its_code() -> None:
    # Under torch.distributed abort is the same immediate exit the raise cases go through.
    rank = FAILING[("abort", 2)]
    code, out, ended = _launch("mpirun", "mpi", 2, ["abort", str(rank)])
    _check_ended_in_time("abort", rank, code, out, ended)
    assert code == 3, out  # mpiexec passes MPI_Abort's code on
