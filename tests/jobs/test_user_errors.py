"""User errors end a job with one line on stderr and exit status 2, once per job; bugs and
``--debug`` keep the traceback. Checked in-process for the rules, through the installed
``hybridrec`` console script and ``python -m hybridrec`` for what a user sees, and under
a real ``mpirun`` (2 and 4 ranks) for "once per job" and "peers do not hang"."""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from comm import CommTimeoutError
from hybridrec.cli import commands
from hybridrec.cli.errors import (
    DEBUG_ENV,
    describe,
    is_user_error,
    reported_errors,
    show_tracebacks,
)
from multiproc import free_port, mpirun_path, rank_env, rank_script
from ps.redis.conn import RedisAuthError, RedisUnavailableError

CONSOLE = Path(sys.executable).parent / "hybridrec"  # installed by pyproject [project.scripts]
TINY_DLRM = shlex.split(
    "--data synthetic --synthetic-samples 400 --synthetic-rows 50 --batch-size 50 "
    "--backend local --no-progress"
)


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    show_tracebacks(False)
    yield
    show_tracebacks(False)


def _env(**extra: str) -> dict[str, str]:
    """The environment of a launched job (this checkout first on the path: the console
    script would otherwise import the installed copy), without a debug setting."""
    env = rank_env(**extra)
    if DEBUG_ENV not in extra:
        env.pop(DEBUG_ENV, None)
    return env


def _run(cmd: list[str], tmp_path: Path, timeout: float = 150, **env: str) -> tuple[int, str, str]:
    run = subprocess.run(
        cmd, cwd=tmp_path, env=_env(**env), capture_output=True, text=True, timeout=timeout
    )
    return run.returncode, run.stdout, run.stderr


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("hybridrec: error:")]


# ---------------------------------------------------------------- the rules, in-process


def _reported(exc: BaseException, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as info, reported_errors():
        raise exc
    return int(info.value.code or 0), capsys.readouterr().err


@pytest.mark.parametrize(
    ("exc", "line"),
    [
        (ValueError("--batch-size must be >= 1, got 0"), "--batch-size must be >= 1, got 0"),
        (TypeError("bad type for x"), "bad type for x"),
        (FileNotFoundError("Criteo data: a.tsv is missing"), "Criteo data: a.tsv is missing"),
        (RedisUnavailableError("cannot reach Redis at h:1"), "cannot reach Redis at h:1"),
        (RedisAuthError("Redis at h:1 refused access"), "Redis at h:1 refused access"),
        (CommTimeoutError("allreduce: no answer\nfrom rank 3"), "allreduce: no answer from rank 3"),
    ],
)
def test_user_errors_are_one_line_and_exit_2(
    exc: BaseException, line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert is_user_error(exc)
    code, err = _reported(exc, capsys)
    assert (code, err) == (2, f"hybridrec: error: {line}\n")


def test_an_os_error_from_open_is_shown_without_its_errno(tmp_path: Path) -> None:
    with pytest.raises(OSError) as info:
        open(tmp_path / "missing.tsv")  # noqa: SIM115 - the error is the point
    assert describe(info.value) == f"No such file or directory: '{tmp_path / 'missing.tsv'}'"


@pytest.mark.parametrize(
    "exc",
    [AssertionError("invariant"), RuntimeError("kernel failed"), KeyError("x"), ValueError()],
)
def test_programming_errors_keep_their_traceback(exc: BaseException) -> None:
    assert not is_user_error(exc)
    with pytest.raises(type(exc)), reported_errors():
        raise exc


def test_debug_flag_and_environment_let_the_traceback_through(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ValueError, match="^--batch-size must be >= 1, got 0$"):
        commands.main(["train-dlrm", "--batch-size", "0", "--debug"])
    show_tracebacks(False)
    with pytest.raises(ValueError, match="--batch-size: invalid int value"):
        commands.main(["--debug", "train-dlrm", "--batch-size", "x"])
    show_tracebacks(False)
    monkeypatch.setenv(DEBUG_ENV, "1")
    with pytest.raises(FileNotFoundError), reported_errors():
        raise FileNotFoundError("x.tsv")


def test_nested_wrappers_print_once(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info, reported_errors(), reported_errors():
        raise ValueError("--lr must be > 0, got 0.0")
    assert info.value.code == 2
    assert capsys.readouterr().err == "hybridrec: error: --lr must be > 0, got 0.0\n"


# ---------------------------------------------------------------- the command, in-process


def test_command_help_version_and_unknown_commands(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib import metadata

    commands.main(["--help"])
    out = capsys.readouterr().out
    assert "train-dlrm" in out and "train-lm" in out and "--debug" in out
    # every data source is named: the DLRM job's five (--data) and the LM's text files
    for source in ("MovieLens-100k", "synthetic", "Criteo", "CSV/TSV/Parquet", "RecBole",
                   "Shakespeare", "text files"):  # fmt: skip
        assert source in out, (source, out)
    commands.main(["--version"])
    assert capsys.readouterr().out == f"hybridrec {metadata.version('hybridrec')}\n"
    with pytest.raises(SystemExit) as info:
        commands.main(["train-dlr"])
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        "hybridrec: error: unknown command 'train-dlr'; did you mean 'train-dlrm'? the "
        "commands are train-dlrm, train-lm, train-seq, evaluate, predict, export "
        "(hybridrec --help)\n"
    )
    with pytest.raises(SystemExit) as info:
        commands.main([])
    assert info.value.code == 2 and "usage: hybridrec" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        commands.main(["train-lm", "--help"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith("usage: hybridrec train-lm [-h] [--config CONFIG]")


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        ("train-dlrm --batch-size 0", "--batch-size must be >= 1, got 0"),
        ("train-dlrm --cache-policy fifo", "--cache-policy: invalid choice: 'fifo'"),
        ("train-lm --max-steps 2.5", "--max-steps: invalid int value: '2.5'"),
        ("train-dlrm --config missing.toml", "config file missing.toml does not exist"),
        (
            "train-dlrm --data criteo --criteo-path missing.tsv --criteo-rows 10",
            "Criteo data: missing.tsv does not exist or is not a file",
        ),
    ],
)
def test_command_reports_user_errors_in_one_line(
    argv: str, line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        commands.main([*argv.split(), "--no-progress"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("hybridrec: error: "), err
    assert line in err, err


# ---------------------------------------------------------------- what a user sees


@pytest.mark.timeout(200)
def test_console_script_runs_a_job_and_reports_errors(tmp_path: Path) -> None:
    assert CONSOLE.exists(), f"{CONSOLE}: the hybridrec console script is not installed"
    metrics = tmp_path / "m.jsonl"
    code, out, err = _run(
        [str(CONSOLE), "train-dlrm", *TINY_DLRM, "--max-steps", "3", "--log-every", "1",
         "--metrics-out", str(metrics)],
        tmp_path,
    )  # fmt: skip
    assert code == 0, out + err
    assert "test AUC" in out
    steps = [line for line in metrics.read_text().splitlines() if '"kind": "step"' in line]
    assert len(steps) == 3  # --max-steps 3, one line per step

    code, out, err = _run([str(CONSOLE), "train-dlrm", "--batch-size", "0"], tmp_path)
    assert (code, err) == (2, "hybridrec: error: --batch-size must be >= 1, got 0\n"), out + err
    code, out, err = _run([str(CONSOLE), "train-dlrm", "--batch-size", "0", "--debug"], tmp_path)
    assert code != 0 and "Traceback (most recent call last)" in err, err
    assert err.rstrip().endswith("ValueError: --batch-size must be >= 1, got 0"), err


@pytest.mark.timeout(200)
def test_python_m_runs_a_job_and_an_unreachable_redis_is_one_line(tmp_path: Path) -> None:
    code, out, err = _run(
        [sys.executable, "-m", "hybridrec", "train-lm", "--max-steps", "2", "--eval-every", "2",
         "--eval-batches", "1", "--max-bytes", "20000", "--batch-size", "4", "--block-size",
         "16", "--no-progress", "--backend", "local"],
        tmp_path,
    )  # fmt: skip
    assert code == 0, out + err
    assert "final val loss" in out
    port = free_port()  # nothing listens there: a real connection refusal
    code, out, err = _run(
        [sys.executable, "-m", "hybridrec", "train-dlrm", *TINY_DLRM,
         "--ps", f"redis://127.0.0.1:{port}/0"],
        tmp_path,
    )  # fmt: skip
    assert code == 2, out + err
    assert _error_lines(err) == err.splitlines(), err
    (line,) = _error_lines(err)
    assert f"cannot reach Redis at 127.0.0.1:{port}" in line and "refused" in line, line


# ---------------------------------------------------------------- under mpirun


def _mpirun(n: int, args: list[str], tmp_path: Path) -> tuple[int, str, float]:
    t0 = time.monotonic()
    code, out, err = _run([mpirun_path(), "-n", str(n), sys.executable, *args], tmp_path)
    return code, out + err, time.monotonic() - t0


@pytest.mark.timeout(300)
def test_mpirun_prints_a_user_error_once(tmp_path: Path) -> None:
    # before communication starts: every rank hits it, rank 0 alone prints it
    code, out, _ = _mpirun(2, ["-m", "hybridrec", "train-dlrm", "--batch-size", "0"], tmp_path)
    assert code == 2, out
    assert out.splitlines() == ["hybridrec: error: --batch-size must be >= 1, got 0"], out
    # after communication started (the store is opened on every rank): once, the job ends
    port = free_port()
    args = ["-m", "hybridrec", "train-dlrm", *TINY_DLRM[:-3], "--ps", f"redis://127.0.0.1:{port}/0"]
    code, out, _ = _mpirun(2, args, tmp_path)
    assert code == 2, out
    (line,) = out.splitlines()  # the whole output of the job: no traceback, no MPI notice
    assert line.startswith("hybridrec: error: ") and f"Redis at 127.0.0.1:{port}" in line, out


@pytest.mark.timeout(200)
def test_mpirun_a_user_error_on_one_rank_ends_the_job(tmp_path: Path) -> None:
    # rank 2 of 4 fails after comm.init while ranks 0, 1 and 3 wait for it in an
    # allreduce (120 s timeout): the job ends with rank 2's line, once
    script = str(rank_script("user_error_one_rank.py"))
    code, out, seconds = _mpirun(4, [script, "2"], tmp_path)
    assert code == 2, out
    assert out.splitlines() == ["hybridrec: error: [rank 2] train file of rank 2 is missing"], out
    assert seconds < 60, f"took {seconds:.0f} s: the waiting ranks were not ended"
