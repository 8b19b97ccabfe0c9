"""Ctrl-C and SIGTERM end a job cleanly (``hybridrec/train/interrupts.py``), on real launchers.

A job is signalled once it has trained a few steps (its metrics file says so): the
first signal finishes the step, writes a checkpoint, prints ``interrupted at step N;
resume with --resume`` once, and every rank exits 130; ``--resume`` then continues at
step N. Under ``python -m hybridrec`` (DLRM and LM), ``mpirun -n 2`` (two workers, and one
worker with a PS server rank, which exits 130 too) and ``torchrun --nproc_per_node 2``
(whose agent turns Ctrl-C into a signal to its workers and then exits with its own
status). A second signal stops at once: one line, exit 130, no traceback.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from multiproc import mpirun_path, rank_env

pytestmark = pytest.mark.timeout(240)

DLRM = shlex.split(
    "train-dlrm --data synthetic --synthetic-samples 200000 --synthetic-rows 500 "
    "--batch-size 100 --dim 8 --log-every 1 --no-progress"
)
LM = shlex.split(
    "train-lm --max-steps 100000 --eval-every 100000 --eval-batches 1 --max-bytes 200000 "
    "--batch-size 4 --block-size 16 --log-every 1 --no-progress"
)
TORCHRUN = Path(sys.executable).parent / "torchrun"
HEARD = "stopping after this step; Ctrl-C again stops at once"


def _steps_logged(metrics: Path) -> int:
    if not metrics.exists():
        return 0
    return sum('"kind": "step"' in line for line in metrics.read_text().splitlines())


def _interrupt(
    cmd: list[str],
    cwd: Path,
    *,
    second_at: str | None = None,
    after_steps: int = 3,
    timeout: float = 150,
) -> tuple[int, str]:
    """Run ``cmd``; once its metrics file shows ``after_steps`` steps send SIGINT to the
    launcher; with ``second_at`` a second one as soon as the job printed a line starting
    so (a second signal before the handler ran for the first would count as one);
    (exit status, everything printed)."""
    metrics = cwd / "m.jsonl"
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=rank_env(inherit=False), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    lines: list[str] = []
    heard = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if second_at is not None and line.startswith(second_at):
                heard.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + timeout
        while _steps_logged(metrics) < after_steps:
            if proc.poll() is not None or time.monotonic() > deadline:
                said = "".join(lines)
                raise AssertionError(f"the job ended or stalled before its steps:\n{said}")
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        if second_at is not None:
            assert heard.wait(timeout), "".join(lines)
            proc.send_signal(signal.SIGINT)
        proc.wait(timeout=timeout)
        reader.join(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, "".join(lines)


def _stopped_at(out: str) -> int:
    """The step of the one ``interrupted at step N; resume with --resume`` line."""
    lines = [line for line in out.splitlines() if line.startswith("interrupted at step")]
    assert len(lines) == 1, out  # printed once, by rank 0
    head, _, tail = lines[0].partition("; ")
    assert tail == "resume with --resume", out
    return int(head.removeprefix("interrupted at step "))


def _check_resume(
    cwd: Path, base: list[str], at: int, steps_flag: str, launcher: list[str] | None = None
) -> None:
    """The checkpoint is at the interrupted step, and ``--resume`` continues from it."""
    ck = cwd / "ck"
    assert (ck / "latest").read_text().strip() == f"step-{at:08d}"
    assert json.loads((ck / f"step-{at:08d}" / "meta.json").read_text())["step"] == at
    done = subprocess.run(
        [*(launcher or [sys.executable]), "-m", "hybridrec", *base, "--resume", steps_flag,
         str(at + 2)],
        cwd=cwd, env=rank_env(inherit=False), capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"resumed from ck/step-{at:08d} at step {at}" in done.stdout, done.stdout


@pytest.mark.parametrize("job", ["dlrm", "lm"])
def test_ctrl_c_under_python_saves_and_exits_130(tmp_path: Path, job: str) -> None:
    base = [*(DLRM if job == "dlrm" else LM), "--checkpoint-dir", "ck", "--metrics-out", "m.jsonl"]
    code, out = _interrupt([sys.executable, "-m", "hybridrec", *base], tmp_path)
    assert code == 130, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    at = _stopped_at(out)
    _check_resume(tmp_path, base, at, "--max-steps")


@pytest.mark.parametrize("ps", ["local", "mpi"])
def test_ctrl_c_under_mpirun_stops_every_rank_after_the_same_step(tmp_path: Path, ps: str) -> None:
    """Two workers (``local``), or one worker and a PS server rank (``mpi``)."""
    base = [*DLRM, "--checkpoint-dir", "ck", "--metrics-out", "m.jsonl", "--ps", ps]
    cmd = [mpirun_path(), "-n", "2", sys.executable, "-m", "hybridrec", *base]
    code, out = _interrupt(cmd, tmp_path)
    assert code == 130, out  # mpiexec reports its ranks' status: all of them 130
    assert "Traceback" not in out and "Abort" not in out, out
    assert out.splitlines().count(HEARD) == 1, out  # rank 0 says it heard the request
    at = _stopped_at(out)
    again = [*DLRM, "--checkpoint-dir", "ck", "--ps", ps]
    _check_resume(tmp_path, again, at, "--max-steps", [mpirun_path(), "-n", "2", sys.executable])


def test_ctrl_c_under_torchrun_saves_once(tmp_path: Path) -> None:
    base = [*DLRM, "--checkpoint-dir", "ck", "--metrics-out", "m.jsonl"]
    cmd = [str(TORCHRUN), "--nproc_per_node", "2", "-m", "hybridrec", *base]
    _code, out = _interrupt(cmd, tmp_path)  # the agent exits with its own status
    at = _stopped_at(out)
    assert f"step-{at:08d}" in os.listdir(tmp_path / "ck")
    assert "hybridrec: error" not in out, out


def test_a_second_ctrl_c_stops_at_once(tmp_path: Path) -> None:
    """The second signal comes once the job said it heard the first, while it still
    finishes its step (a large batch keeps it busy) or writes its metrics and plot: it
    stops there, in one line."""
    base = [*DLRM, "--batch-size", "20000", "--metrics-out", "m.jsonl"]
    code, out = _interrupt([sys.executable, "-m", "hybridrec", *base], tmp_path, second_at=HEARD)
    assert code == 130, out
    assert "Traceback" not in out, out
    said = "hybridrec: interrupted (a second SIGINT: stopped at once); nothing more was saved"
    assert out.splitlines().count(said) == 1, out


def test_a_second_ctrl_c_as_the_job_ends_still_exits_130(tmp_path: Path) -> None:
    """A second signal once the job said where it stopped: it lands while the job writes
    its metrics, or after (where the exit ignores it), or while the interpreter shuts
    down (where, not ignored, it would end the process with a signal's status or a
    fatal error): always exit 130 and no traceback."""
    base = [*DLRM, "--metrics-out", "m.jsonl"]
    cmd = [sys.executable, "-m", "hybridrec", *base]
    code, out = _interrupt(cmd, tmp_path, second_at="interrupted at step")
    assert code == 130, out
    assert "Traceback" not in out and "Fatal" not in out, out
