"""One rank fails, the whole job ends: an uncaught exception never leaves peers waiting.

Without help, a rank that raises simply exits; its peers sit in their next
collective until the group's timeout (300 s by default) runs out. So when
:func:`comm.init` creates a world group of more than one rank it installs a
``sys.excepthook`` (as ``python -m mpi4py`` does) that

1. prints the traceback with every line prefixed ``[rank R]`` (under ``mpirun``
   every rank's output lands in one stream), then flushes stdout and stderr; a
   hook the program installed before ``comm.init`` prints instead, after one
   ``[rank R]`` line;
2. calls :func:`abort`, which ends every rank of the job at once.

How :func:`abort` ends the job depends on what this process runs:

* MPI, world size > 1 (``mpirun``, backend mpi, or gloo whose address MPI agreed
  on): ``MPI.COMM_WORLD.Abort(code)``; mpiexec kills every rank of the job.
* torch.distributed (``torchrun``; gloo or nccl under ``mpirun`` without MPI):
  ``os._exit(code)`` at once, with no atexit handler and no process-group teardown
  that could wait on a dead peer. torchrun then stops the other workers, mpiexec
  kills the rest on a non-zero exit, and peers blocked in a gloo collective see the
  connection close and fail (and abort) on their own.
* a single process, or before ``comm.init``: ``raise SystemExit(code)``, an
  ordinary exit (``finally`` blocks and atexit handlers run).

A ``finally: group.close()`` runs before the hook: while an exception is on its
way out, ``close()`` neither waits for peers nor takes the hook away (see
:func:`exception_in_flight`); a close on the normal path restores the previous
hook, so a clean exit is unaffected.

Exceptions in threads other than the main one are left to ``threading.excepthook``
(printed, the thread ends, the process goes on): this project starts no threads of
its own, and a library's helper thread that fails (a progress bar's monitor, say)
should not end a training job. A thread whose result the main thread waits for
through a collective is covered anyway: the main thread times out or fails.
"""

from __future__ import annotations

import inspect
import os
import sys
import time
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import Any, NoReturn

_ExceptHook = Callable[[type[BaseException], BaseException, TracebackType | None], Any]

# The hook this module installed, who owns it, and what it replaced. One world
# group per process, so module state is enough (and it is what sys.excepthook is).
_owner: object | None = None
_previous: _ExceptHook | None = None
# How long a rank waits between its last output and MPI_Abort, so that mpirun forwards
# the output before it ends the job (see _end_distributed_job).
ABORT_FLUSH_S = 0.5

_label = ""


def abort(exit_code: int) -> NoReturn:
    """End every rank of the job now, with ``exit_code`` (0..255) as the exit status.

    Under ``mpirun`` with MPI running this is ``MPI_Abort`` on ``COMM_WORLD``; under
    torch.distributed (``torchrun``) this process exits at once (``os._exit``) so the
    launcher stops the others; in a single process, or before :func:`comm.init`,
    it raises ``SystemExit(exit_code)``. stdout and stderr are flushed first.
    """
    if isinstance(exit_code, bool) or not isinstance(exit_code, int) or not 0 <= exit_code <= 255:
        raise ValueError(f"abort: exit_code must be an int in 0..255, got {exit_code!r}")
    _flush()
    _end_distributed_job(exit_code)
    raise SystemExit(exit_code)


def exception_in_flight() -> bool:
    """True inside an ``except`` or ``finally`` block that an exception is passing through.

    Groups ask this in ``close()``: a close on the way out of a failure must not
    wait for peers that are themselves waiting for this rank, and must leave the
    abort hook in place for the exception to reach.
    """
    return sys.exc_info()[1] is not None


def install_abort_hook(owner: object, rank: int) -> None:
    """Make an uncaught exception on this rank print its labelled traceback and end the job.

    ``owner`` is the world group; only its ``close()`` (see :func:`release_abort_hook`)
    restores the hook that was there before. A second world group replaces the owner.
    """
    global _owner, _previous, _label
    if _owner is None:
        _previous = sys.excepthook
    _owner = owner
    _label = f"[rank {rank}]"
    sys.excepthook = _abort_on_uncaught


def release_abort_hook(owner: object) -> None:
    """``owner`` closed normally: put back the hook :func:`install_abort_hook` replaced."""
    global _owner, _previous
    if _owner is not owner:
        return
    if sys.excepthook is _abort_on_uncaught and _previous is not None:
        sys.excepthook = _previous
    _owner = None
    _previous = None


def _abort_on_uncaught(
    exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
) -> None:
    try:
        head = f"{_label} uncaught {exc_type.__name__}: ending the whole job\n"
        own = _programs_hook(_previous)
        if own is not None:
            # The program has its own hook (one-line user errors, say): it prints.
            sys.stderr.write(head)
            sys.stderr.flush()
            own(exc_type, exc, tb)
        else:
            lines = "".join(traceback.format_exception(exc_type, exc, tb)).splitlines()
            # One write per rank, so lines from different ranks do not interleave.
            sys.stderr.write(head + "".join(f"{_label} {line}\n" for line in lines))
    except Exception:  # a broken stderr or hook must not stop the abort
        pass
    finally:
        _flush()
        _end_distributed_job(1)
        os._exit(1)  # torch.distributed already torn down: still never return


def _end_distributed_job(exit_code: int) -> None:
    """MPI_Abort, or exit at once under torch.distributed; returns only in a lone process.

    Under mpirun the last lines this rank wrote are in the pipe to the launcher's proxy,
    and an abort at once can end the job before the proxy forwarded them (a job that
    failed saying nothing, or without its traceback): it waits ``ABORT_FLUSH_S`` first."""
    job = running_job()
    if job == "mpi":
        time.sleep(ABORT_FLUSH_S)
        _mpi_world().Abort(exit_code)
    if job == "torch":
        os._exit(exit_code)


def _programs_hook(hook: _ExceptHook | None) -> _ExceptHook | None:
    """The excepthook the program installed, or None when it is Python's default.

    ``torch.distributed.init_process_group`` wraps whatever hook was there in one that
    prefixes ``[rankN]:`` to each line; that wrapper is looked through (its
    ``old_hook``), so a torch job prints the same labelled traceback as an MPI one.
    """
    while hook is not None and hook is not sys.__excepthook__:
        if getattr(hook, "__name__", "") != "_distributed_excepthook" or not getattr(
            hook, "__module__", ""
        ).startswith("torch.distributed"):
            return hook
        hook = inspect.getclosurevars(hook).nonlocals.get("old_hook")
    return None


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:  # a closed stream: nothing left to flush
            pass


def running_job() -> str | None:
    """``"mpi"`` when this process runs MPI with more than one rank, ``"torch"`` when
    torch.distributed is initialised, else None (a lone process). Starts nothing."""
    world = _mpi_world()
    if world is not None and world.Get_size() > 1:
        return "mpi"
    return "torch" if _torch_distributed_running() else None


def _mpi_world() -> Any:
    """``MPI.COMM_WORLD`` if this process already started MPI (never starts it), else None."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        return None
    if not mpi.Is_initialized() or mpi.Is_finalized():
        return None
    return mpi.COMM_WORLD


def _torch_distributed_running() -> bool:
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())
