"""User errors end a job with one line; programming errors keep their traceback.

Wrap a job's entry point::

    with reported_errors():
        main()

A *user error* is something the person running the job can fix: a bad option
value or config file, a missing or unreadable file, a store that cannot be
reached. It prints one line to stderr and ends the job with exit status 2::

    hybridrec: error: --batch-size must be >= 1, got 0

What counts (:func:`is_user_error`): ``ValueError``, ``TypeError``,
``FileNotFoundError``, ``PermissionError``, ``IsADirectoryError``,
``NotADirectoryError``, ``ConnectionError`` and ``TimeoutError`` (the stores raise
these for an unreachable Redis or a dead server rank), each with a message. Any
other exception (an ``AssertionError``, a ``RuntimeError``, ...) is a bug and passes
through with its traceback, as does every exception with ``--debug`` on the
command line (:func:`show_tracebacks`) or ``HYBRIDREC_DEBUG=1`` in the environment.

Once per job, under ``mpirun`` or ``torchrun`` too:

* before communication starts every rank parses the same command line and config
  file, so every rank hits the same error: only launch rank 0
  (:func:`comm.detect_launch`) prints it, the others exit quietly;
* after communication started the error may be this rank's alone while its peers
  wait for it in a collective, so the job is ended with ``comm.abort(2)``. Rank 0
  prints and aborts at once; another rank first waits :data:`PEER_GRACE_S`, in which
  rank 0's abort ends it if rank 0 hit the same error, and then prints its line
  (labelled ``[rank R]``) and aborts.

A ``KeyboardInterrupt`` that reaches it (a second Ctrl-C, :mod:`hybridrec.train.interrupts`)
is one line too, ``hybridrec: interrupted ...``, and exit status 130 (under ``mpirun``
every rank ends); with ``--debug`` it keeps its traceback.

Nesting is harmless: an inner ``reported_errors`` turns the error into
``SystemExit(2)``, which an outer one lets through.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from types import TracebackType
from typing import Any, NoReturn

__all__ = [
    "DEBUG_ENV",
    "EXIT_INTERRUPTED",
    "EXIT_USER_ERROR",
    "describe",
    "is_user_error",
    "launch_rank",
    "report_user_error",
    "reported_errors",
    "show_tracebacks",
    "tracebacks_shown",
]

DEBUG_ENV = "HYBRIDREC_DEBUG"
EXIT_USER_ERROR = 2  # as argparse exits on a bad command line
EXIT_INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a job ended by Ctrl-C
PROG = "hybridrec"

# How long a rank other than 0 waits before printing an error that arose after
# communication started: long enough for rank 0, which usually hits the same
# error at about the same moment, to abort the job first (the line then appears
# once); short enough that an error of this rank alone still ends the job promptly.
PEER_GRACE_S = 5.0

USER_ERROR_TYPES: tuple[type[BaseException], ...] = (
    ValueError,
    TypeError,
    FileNotFoundError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    ConnectionError,
    TimeoutError,
)

_tracebacks_asked = False


def show_tracebacks(on: bool = True) -> None:
    """``--debug``: let user errors through with their full traceback (process-wide)."""
    global _tracebacks_asked
    _tracebacks_asked = on


def tracebacks_shown() -> bool:
    """True after ``--debug`` or with ``HYBRIDREC_DEBUG`` set to 1/true/yes/on."""
    env = os.environ.get(DEBUG_ENV, "").strip().lower()
    return _tracebacks_asked or env in ("1", "true", "yes", "on")


def _is_redis_connection_error(err: BaseException) -> bool:
    """redis-py's own connection errors (not builtin subclasses), should one get through
    untranslated; redis is only looked at if something already imported it."""
    exceptions = sys.modules.get("redis.exceptions")
    if exceptions is None:
        return False
    return isinstance(err, exceptions.ConnectionError | exceptions.TimeoutError)


def is_user_error(err: BaseException) -> bool:
    """Whether ``err`` is reported as one line (see the module docstring)."""
    if not str(err).strip():
        return False  # nothing to tell the user: the traceback is all there is
    return isinstance(err, USER_ERROR_TYPES) or _is_redis_connection_error(err)


def describe(err: BaseException) -> str:
    """``err``'s message on one line (an OSError from ``open`` without its errno)."""
    if isinstance(err, OSError) and err.strerror and err.filename is not None:
        text = f"{err.strerror}: {err.filename!r}"
        if err.filename2 is not None:
            text += f" -> {err.filename2!r}"
    else:
        text = str(err)
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def launch_rank() -> tuple[int, int]:
    """(rank, size) as the launcher set them; (0, 1) if they cannot be read."""
    try:
        from comm import detect_launch

        launch = detect_launch()
    except Exception:  # a broken launcher variable: report as a lone process
        return 0, 1
    return launch.rank, launch.size


def _running_job() -> str | None:
    """``comm.running_job()``: "mpi", "torch" or None (imported here, not at the top:
    ``--help`` and ``--version`` load no torch)."""
    if "comm" not in sys.modules:
        return None  # no communication can have started without the comm package
    import comm

    return comm.running_job()


def _quiet_stderr() -> None:
    """Point this process's stderr (file descriptor 2) at the null device."""
    with contextlib.suppress(OSError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)
        os.close(null)


def report_user_error(err: BaseException) -> NoReturn:
    """Print ``err`` as one line (once per job) and end the job with exit status 2."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()  # what the job printed so far comes before the error line
    rank, size = launch_rank()
    line = f"{PROG}: error: {describe(err)}"
    if size > 1 and _running_job() is not None:
        if rank != 0:
            time.sleep(PEER_GRACE_S)  # rank 0's abort ends this rank here if it failed too
            line = f"{PROG}: error: [rank {rank}] {describe(err)}"
        print(line, file=sys.stderr, flush=True)
        if _running_job() == "mpi":
            _quiet_stderr()  # MPI_Abort's own notice would repeat the line with less in it
        import comm  # here, not at the top: --help and --version load no torch

        # Every rank ends: MPI_Abort (after a pause that lets mpirun forward the line),
        # or exit under torchrun.
        comm.abort(EXIT_USER_ERROR)
    if rank == 0:
        print(line, file=sys.stderr, flush=True)
    raise SystemExit(EXIT_USER_ERROR)


def report_interrupt(err: KeyboardInterrupt) -> NoReturn:
    """A Ctrl-C that stopped the job at once (a second one, or one where no job watches,
    :mod:`hybridrec.train.interrupts`): one line, exit status 130 on every rank."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    rank, size = launch_rank()
    if rank == 0:
        why = f" ({describe(err)})" if str(err).strip() else ""
        print(f"{PROG}: interrupted{why}; nothing more was saved", file=sys.stderr, flush=True)
    if size > 1 and _running_job() == "mpi":
        _quiet_stderr()  # MPI_Abort's notice would follow the line
        import comm

        comm.abort(EXIT_INTERRUPTED)
    raise SystemExit(EXIT_INTERRUPTED)


def _exit_status(exc: BaseException | None) -> object:
    return exc.code if isinstance(exc, SystemExit) else None


def _ignore_stop_signals() -> None:
    """The process exits for a stop request: a further Ctrl-C or SIGTERM would only cut
    the exit short, and one that lands while the interpreter shuts down can end it
    with a signal's status or a fatal error. Only the main thread can set handlers."""
    with contextlib.suppress(ValueError):
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)


class reported_errors(contextlib.ContextDecorator):  # noqa: N801 - used like a function
    """Context manager (or decorator): a user error inside becomes one line on stderr
    and exit status 2; everything else passes through unchanged."""

    def __enter__(self) -> reported_errors:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Any:
        if isinstance(exc, KeyboardInterrupt) or _exit_status(exc) == EXIT_INTERRUPTED:
            _ignore_stop_signals()
        if isinstance(exc, KeyboardInterrupt) and not tracebacks_shown():
            report_interrupt(exc)
        if exc is None or not is_user_error(exc) or tracebacks_shown():
            return False  # propagate: a bug, a SystemExit, --debug, or no error at all
        report_user_error(exc)
