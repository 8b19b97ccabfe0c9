"""Killing ranks of a real training job under ``mpirun``: it stops, says why, and resumes exactly.

The job is ``tests/jobs/ranks/fault_train.py`` (2 workers + 1 MPI parameter server,
a hybrid embedding table and a linear head, checkpoints every 5 steps). What
MPICH's launcher (hydra, from the ``mpich`` wheel) does decides what a test can
see, so each fault is tested the way it actually shows:

* **server SIGKILLed**: hydra tears the whole job down at once, with or without
  ``-disable-auto-cleanup`` (a rank killed by a signal always ends the job); no
  rank lives on to name the dead one, hydra prints ``Killed (signal 9)``. The test
  checks that the job ends within 30 s with a non-zero code, then **resumes** from
  the last finished checkpoint in a fresh ``mpirun`` and checks that every loss
  after it equals an uninterrupted run's bit for bit (a resume at the saving worker
  count repeats the saving run, docs/numerics.md: the data is a pure function of the
  step and the workers' ids are disjoint).
* **server hung** (SIGSTOP: the process is there but never answers, like a machine
  that vanished from the network) under ``-disable-auto-cleanup``: the launcher
  sees nothing, so our code must: every worker raises ``CommTimeoutError`` naming
  "server rank(s) [2]" and exits non-zero within 30 s (``request_timeout_s`` 3 s).
* **worker SIGKILLed**: hydra ends the job within seconds, ``Killed (signal 9)``.
* **worker hung** (SIGSTOP): the other worker's allreduce gives up after the
  group's ``timeout_s`` (5 s) with ``CommTimeoutError``, the worker exits
  non-zero and hydra then ends the job; no hang.
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

from multiproc import ROOT, mpirun_path, rank_env

SCRIPT = ROOT / "tests" / "jobs" / "ranks" / "fault_train.py"
SERVER, WORKERS = 2, (0, 1)
STEPS = 30
KILL_AFTER_STEP = 10  # kill once this step's checkpoint is finished
LIMIT_S = 30.0  # a dead or hung rank must end the job (or be reported) within this


class Job:
    """One ``mpirun -n 3 fault_train.py`` in the background, output to a file."""

    def __init__(self, folder: Path, *args: str, flags: tuple[str, ...] = ()) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.log = folder / f"mpirun-{time.monotonic_ns()}.log"
        env = rank_env(inherit=False)
        cmd = [mpirun_path(), *flags, "-n", "3", sys.executable, str(SCRIPT)]
        cmd += ["--dir", str(folder), *args]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                cmd,
                env=env,
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # so a stuck job can be killed whole
            )

    def pid(self, rank: int) -> int:
        return int((self.folder / f"pid.{rank}").read_text())

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for_checkpoint(self, step: int, timeout: float = 90.0) -> None:
        meta = self.folder / "ckpt" / f"step-{step:06d}" / "meta.json"
        deadline = time.monotonic() + timeout
        while not meta.is_file():
            if self.proc.poll() is not None:
                raise AssertionError(f"job ended before step {step}:\n{self.output()}")
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"no checkpoint of step {step} in {timeout} s")
            time.sleep(0.05)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"the job did not end within {timeout} s (hang):\n{self.output()}"
            ) from None

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)


def _losses(text: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(r"rank 0: step (\d+) loss (\S+)", text)}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (dead, not yet reaped by its launcher proxy) counts as gone.
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def _run_to_end(folder: Path, *args: str) -> str:
    job = Job(folder, "--steps", str(STEPS), *args)
    code = job.wait(timeout=150)
    out = job.output()
    assert code == 0, f"exit {code}:\n{out}"
    assert out.count("ok worker done") == 2 and "ok server returned" in out, out
    return out


@pytest.mark.timeout(300)
def test_server_killed_ends_the_job_and_a_resume_matches_an_uninterrupted_run(
    tmp_path: Path,
) -> None:
    reference = _losses(_run_to_end(tmp_path / "reference"))
    assert sorted(reference) == list(range(1, STEPS + 1))

    job = Job(tmp_path / "run", "--steps", str(STEPS), "--ckpt-every", "5", "--step-sleep", "0.3")
    job.wait_for_checkpoint(KILL_AFTER_STEP)
    t0 = time.monotonic()
    os.kill(job.pid(SERVER), signal.SIGKILL)
    code = job.wait(timeout=LIMIT_S + 30)
    ended = time.monotonic() - t0
    out = job.output()
    assert code != 0, out
    assert ended < LIMIT_S, f"the job took {ended:.1f} s to end after the server died"
    assert "ok worker done" not in out, out
    assert "Killed (signal 9)" in out, out  # hydra's report (it names no rank)
    done = max(_losses(out))
    assert KILL_AFTER_STEP <= done < STEPS, out

    # Resume from the newest finished checkpoint, in a fresh job, to step STEPS.
    resumed_out = _run_to_end(tmp_path / "run", "--resume")
    m = re.search(r"rank 0: resumed from step (\d+)", resumed_out)
    assert m is not None, resumed_out
    start = int(m.group(1))
    assert KILL_AFTER_STEP <= start <= done and start % 5 == 0, (start, done)
    resumed = _losses(resumed_out)
    assert sorted(resumed) == list(range(start + 1, STEPS + 1)), resumed_out
    for step, loss in resumed.items():
        # Bit for bit: a resume at the saving worker count repeats the saving run.
        assert loss == reference[step], (step, loss, reference[step])
    # The steps the killed run did before it died match too (same data, same state).
    for step, loss in _losses(out).items():
        assert loss == reference[step], (step, loss, reference[step])


@pytest.mark.timeout(180)
def test_hung_server_every_worker_names_it_and_exits_within_30s(tmp_path: Path) -> None:
    job = Job(
        tmp_path,
        "--steps",
        "200",
        "--ckpt-every",
        "5",
        "--step-sleep",
        "0.2",
        flags=("-disable-auto-cleanup",),
    )
    try:
        job.wait_for_checkpoint(5)
        server = job.pid(SERVER)
        workers = [job.pid(r) for r in WORKERS]
        t0 = time.monotonic()
        os.kill(server, signal.SIGSTOP)
        while any(_alive(p) for p in workers) and time.monotonic() - t0 < LIMIT_S + 20:
            time.sleep(0.1)
        gone = time.monotonic() - t0
        out = job.output()
        assert not any(_alive(p) for p in workers), f"workers still running:\n{out}"
        assert gone < LIMIT_S, f"workers took {gone:.1f} s to stop:\n{out}"
        os.kill(server, signal.SIGKILL)  # what an operator (or a scheduler) does next
        code = job.wait(timeout=30)
    finally:
        job.kill()
    out = job.output()
    assert code != 0, out
    for rank in WORKERS:
        line = re.search(rf"rank {rank}: FAILED (.*)", out)
        assert line is not None, f"worker {rank} printed no error:\n{out}"
        assert "CommTimeoutError" in line.group(1), line.group(1)
        assert f"server rank(s) [{SERVER}]" in line.group(1), line.group(1)
    assert "ok worker done" not in out, out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP"])
def test_dead_or_hung_worker_ends_the_job_without_a_hang(tmp_path: Path, sig: str) -> None:
    """SIGKILL: hydra ends the job at once. SIGSTOP: the other worker's collective gives up
    after the group timeout (5 s), it exits non-zero, and hydra then ends the job."""
    job = Job(tmp_path, "--steps", "200", "--ckpt-every", "5", "--step-sleep", "0.2")
    try:
        job.wait_for_checkpoint(5)
        t0 = time.monotonic()
        os.kill(job.pid(1), getattr(signal, sig))
        code = job.wait(timeout=LIMIT_S + 30)
        ended = time.monotonic() - t0
    finally:
        job.kill()
    out = job.output()
    assert code != 0, out
    assert ended < LIMIT_S, f"the job took {ended:.1f} s to end:\n{out}"
    assert "ok worker done" not in out, out
    if sig == "SIGKILL":
        assert "Killed (signal 9)" in out, out
    else:
        line = re.search(r"rank 0: FAILED (.*)", out)
        assert line is not None, f"worker 0 printed no error:\n{out}"
        assert "CommTimeoutError" in line.group(1), line.group(1)
