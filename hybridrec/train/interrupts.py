"""Ctrl-C and SIGTERM: the first finishes the step and saves, the second stops at once.

A job wraps its run in :func:`watching`. The first SIGINT or SIGTERM only notes the
request (rank 0 says so at once: ``stopping after this step; Ctrl-C again stops at
once``); the :class:`hybridrec.Trainer` asks after every step whether any rank got one
(:func:`stop_agreed`: one 4-byte allreduce per step on several ranks, so every rank
stops after the same step), writes a checkpoint when it has a checkpoint folder, prints
``interrupted at step N; resume with --resume`` once and raises :class:`Interrupted`
(exit status 130, as a shell reports a job ended by SIGINT) on every rank. A PS server
rank serves on until its workers said goodbye and then exits 130 too
(:func:`exit_if_asked`). A second signal raises ``KeyboardInterrupt`` where the process
is; :func:`hybridrec.cli.errors.reported_errors` turns that into one line and exit status
130 (under ``mpirun`` ending every rank). Once a process exits for a stop request,
:func:`hybridrec.cli.errors.reported_errors` ignores further signals: the exit is already
under way, and a signal that lands while the interpreter shuts down would end it with a
signal's status (or worse, where a thread without Python's lock checks for signals).

``mpirun`` forwards a Ctrl-C to every rank; ``torchrun`` turns it into SIGTERM for its
workers: both reach the same handler.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType

import torch

from comm import ProcessGroup
from hybridrec.cli.errors import EXIT_INTERRUPTED, launch_rank

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(SystemExit):
    """Raised on every rank after the step that saw a stop request (exit status 130)."""

    def __init__(self) -> None:
        super().__init__(EXIT_INTERRUPTED)


class _Requests:
    """This process's stop requests: the first signal's number, once one came."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.watching = False
        self.announce = False  # rank 0 says it heard the first one

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
            if self.announce:
                # os.write, not print: the signal may land inside a print to stderr,
                # whose buffer refuses a second writer.
                name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
                os.write(2, f"stopping after this step; {name} again stops at once\n".encode())
            return
        for s in SIGNALS:  # a third one gets Python's default: a KeyboardInterrupt / exit
            signal.signal(s, signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL)
        raise KeyboardInterrupt(f"a second {signal.Signals(signum).name}: stopped at once")


_requests = _Requests()


@contextlib.contextmanager
def watching() -> Iterator[None]:
    """Within: SIGINT and SIGTERM are stop requests (see the module docstring); the
    handlers before are restored after. Only the main thread can take signals; from
    another thread this changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {s: signal.getsignal(s) for s in SIGNALS}
    _requests.signum, _requests.watching = None, True
    _requests.announce = launch_rank()[0] == 0
    for s in SIGNALS:
        signal.signal(s, _requests.handle)
    try:
        yield
    finally:
        _requests.watching = False
        for s, h in before.items():
            signal.signal(s, h)


def asked() -> bool:
    """Whether this process got a stop request."""
    return _requests.signum is not None


def stop_agreed(group: ProcessGroup) -> bool:
    """Collective over ``group`` while :func:`watching`: whether any rank got a stop
    request (all ranks get the same answer); False at once when nothing watches."""
    if not _requests.watching:
        return False
    if group.size == 1:
        return asked()
    flag = torch.tensor([1.0 if asked() else 0.0])
    return bool(group.allreduce(flag, op="max").item() > 0)


def exit_if_asked() -> None:
    """Raise :class:`Interrupted` if this process got a stop request (a PS server rank,
    after serving to the end, or a job that finished its last step as it came)."""
    if asked():
        raise Interrupted()
