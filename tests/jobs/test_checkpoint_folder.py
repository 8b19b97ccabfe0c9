"""A fresh run never mixes its checkpoints with another run's in one folder.

Run A writes checkpoints into a folder; run B, started fresh (no ``--resume``) on the same
folder, stops before training with one line that names A's checkpoints and the three
ways on (``--resume``, another ``--checkpoint-dir``, ``--overwrite-checkpoints``), and
leaves the folder as it was, under ``python -m hybridrec`` and ``mpirun -n 2`` (every rank
stops, the line is printed once). With ``--overwrite-checkpoints`` the folder then holds
B's checkpoints alone and ``latest`` names B's last one, so a ``--resume`` continues B.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from multiproc import mpirun_path, rank_env

pytestmark = pytest.mark.timeout(300)

JOBS = {
    "dlrm": shlex.split(
        "train-dlrm --data synthetic --synthetic-samples 600 --synthetic-rows 50 "
        "--batch-size 50 --dim 8 --checkpoint-every 2 --no-progress"
    ),
    "lm": shlex.split(
        "train-lm --eval-every 2 --eval-batches 1 --max-bytes 20000 --batch-size 4 "
        "--block-size 16 --checkpoint-every 2 --no-progress"
    ),
}
STEPS = {"dlrm": "--max-steps", "lm": "--max-steps"}


def _run(launcher: list[str], args: list[str], cwd: Path) -> tuple[int, str]:
    done = subprocess.run(
        [*launcher, "-m", "hybridrec", *args], cwd=cwd, env=rank_env(inherit=False),
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    return done.returncode, done.stdout + done.stderr


def _folder(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


@pytest.mark.parametrize("job", ["dlrm", "lm"])
def test_a_fresh_run_refuses_another_runs_checkpoints_until_told(tmp_path: Path, job: str) -> None:
    python = [sys.executable]
    base = [*JOBS[job], "--checkpoint-dir", "ck"]
    code, out = _run(python, [*base, STEPS[job], "6"], tmp_path)
    assert code == 0, out
    first = _folder(tmp_path / "ck")
    assert first == ["latest", "step-00000004", "step-00000006"], first

    for launcher in (python, [mpirun_path(), "-n", "2", sys.executable]):
        code, out = _run(launcher, [*base, STEPS[job], "2"], tmp_path)
        assert code == 2, out
        lines = [line for line in out.splitlines() if line.strip()]
        assert len(lines) == 1, out  # one line, printed once, no traceback
        (line,) = lines
        assert line.startswith("hybridrec: error: --checkpoint-dir 'ck' holds checkpoints of")
        for said in ("latest", "step-00000004", "step-00000006", "--resume",
                     "--checkpoint-dir", "--overwrite-checkpoints"):  # fmt: skip
            assert said in line, line
        assert _folder(tmp_path / "ck") == first  # nothing deleted or added

    code, out = _run(python, [*base, STEPS[job], "2", "--overwrite-checkpoints"], tmp_path)
    assert code == 0, out
    assert "deleted the checkpoints of another run" in out, out
    assert _folder(tmp_path / "ck") == ["latest", "step-00000002"]
    assert (tmp_path / "ck" / "latest").read_text().strip() == "step-00000002"
    code, out = _run(python, [*base, STEPS[job], "4", "--resume"], tmp_path)
    assert code == 0, out
    assert "resumed from ck/step-00000002 at step 2" in out, out
