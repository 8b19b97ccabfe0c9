"""No secret reaches a file, a log line or an error message.

A Redis password planted in ``--ps redis://default:<password>@...`` against a real
``redis-server`` with ``requirepass``: the DLRM and the LM job run with checkpoints,
a metrics file and its plot, under ``python -m hybridrec`` and under ``mpirun -n 2``;
then every byte the run wrote (every file under its folder, checkpoints and the plot's
PNG metadata included) and everything it printed is searched for the password. The
recorded store URL reads ``redis://default:***@host:port/0``. The one-line errors of a
bad ``--ps`` option, a wrong password and a dead Redis say what went wrong without it.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from multiproc import free_port, mpirun_path, rank_env
from ps.redact import redact_url
from redis_server import redis_server

pytestmark = pytest.mark.timeout(300)

PLANTED = "Pl4ntedSecretPW"  # nowhere else in the repository or its outputs
DLRM = shlex.split(
    "train-dlrm --data synthetic --synthetic-samples 600 --synthetic-rows 50 --batch-size 50 "
    "--dim 8 --max-steps 4 --checkpoint-every 2 --log-every 1 --no-progress"
)
LM = shlex.split(
    "train-lm --max-steps 4 --eval-every 2 --eval-batches 1 --max-bytes 20000 --batch-size 4 "
    "--block-size 16 --checkpoint-every 2 --placement hybrid --no-progress"
)


def test_redact_url_hides_passwords_and_keeps_the_address() -> None:
    cases = {
        f"redis://default:{PLANTED}@127.0.0.1:6379/0": "redis://default:***@127.0.0.1:6379/0",
        f"redis://:{PLANTED}@h:1/0": "redis://:***@h:1/0",
        f"rediss://u:{PLANTED}@x:y@h/0?cluster=1": "rediss://u:***@h/0?cluster=1",
        f"redis://h:6379/0?password={PLANTED}&db=1": "redis://h:6379/0?password=***&db=1",
        f"at redis://a:{PLANTED}@c and redis://d:e@f.": "at redis://a:***@c and redis://d:***@f.",
        "redis://h:6379/0": "redis://h:6379/0",
        "mpi:2": "mpi:2",
        "local": "local",
    }
    for given, shown in cases.items():
        assert redact_url(given) == shown, given


def _run(cmd: list[str], cwd: Path, timeout: float = 240) -> tuple[int, str]:
    env = rank_env(inherit=False)
    done = subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    return done.returncode, done.stdout + done.stderr


def _leaks(folder: Path) -> list[str]:
    """Every file under ``folder`` whose bytes hold the planted password."""
    needle = PLANTED.encode()
    return [str(p) for p in sorted(folder.rglob("*")) if p.is_file() and needle in p.read_bytes()]


@pytest.mark.parametrize("job", ["dlrm", "lm"])
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_run_writes_and_prints_no_password(tmp_path: Path, job: str, ranks: int) -> None:
    with redis_server(password=PLANTED) as srv:
        url = f"redis://default:{PLANTED}@{srv.host}:{srv.port}/0"
        work = tmp_path / "run"
        work.mkdir()
        args = [*(DLRM if job == "dlrm" else LM), "--ps", url, "--checkpoint-dir", "ck"]
        args += ["--metrics-out", "m.jsonl"]
        launcher = [sys.executable] if ranks == 1 else [mpirun_path(), "-n", "2", sys.executable]
        code, out = _run([*launcher, "-m", "hybridrec", *args], work)
        assert code == 0, out
        assert srv.client().dbsize() > 0  # the run did use the password-protected Redis
    assert PLANTED not in out, out
    written = sorted(p.name for p in work.rglob("*") if p.is_file())
    assert "m.jsonl" in written and "meta.json" in written, written
    assert any(p.endswith(".png") for p in written), written  # the plot and its metadata
    assert _leaks(work) == []
    shown = f"redis://default:***@{srv.host}:{srv.port}/0"
    assert shown in (work / "m.jsonl").read_text()  # the store is still named


def test_errors_name_the_store_without_its_password(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    bad_option = f"redis://default:{PLANTED}@127.0.0.1:{port}/0?bogus=1"
    dead = f"redis://default:{PLANTED}@127.0.0.1:{port}/0"
    with redis_server(password="the-real-one") as srv:
        wrong = f"redis://default:{PLANTED}@{srv.host}:{srv.port}/0"
        for url, says in (
            (bad_option, "unknown query options ['bogus']"),
            (dead, f"cannot reach Redis at 127.0.0.1:{port}"),
            (wrong, f"{srv.host}:{srv.port}"),
        ):
            for launcher in ([sys.executable], [mpirun_path(), "-n", "2", sys.executable]):
                code, out = _run([*launcher, "-m", "hybridrec", *DLRM, "--ps", url], tmp_path)
                assert code == 2, out
                lines = [line for line in out.splitlines() if line.strip()]
                assert len(lines) == 1 and lines[0].startswith("hybridrec: error: "), out
                assert says in lines[0] and PLANTED not in out, out
    assert _leaks(tmp_path) == []
