"""Handles for communication that is in flight.

A handle wraps a backend request (an MPI request, a torch.distributed Work, or
nothing at all for the local group) plus a ``finish`` step that turns the
received buffer into the result (divide for an average, reshape, copy back).
``wait()`` never blocks forever: past its timeout it raises
:class:`CommTimeoutError` naming the operation, so a dead peer is an error
instead of a hang.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

_BUSY_POLLS = 4096  # test() calls (~1 ms) before a waiting rank starts yielding its core


class CommTimeoutError(TimeoutError):
    """A collective or point-to-point operation did not complete in time.

    The group is unusable afterwards (peers may be half-way through the
    operation); close it and stop the job, or resume from a checkpoint.
    """


class Handle:
    """One operation in flight; ``wait()`` returns its result.

    ``test`` returns True once the operation completed (and drives progress for
    MPI, which only advances inside library calls). ``block(limit_s)``, when
    given, waits natively instead of polling ``test`` (torch.distributed's
    point-to-point work only completes inside its own wait) and raises
    :class:`CommTimeoutError` past the limit. ``finish`` runs once, after
    completion, and its return value is what ``wait()`` returns (again on every
    later call).

    ``ordered``, when given, is how ``wait()`` without a timeout waits for work that
    runs on a device: it makes the current stream wait for the operation and returns
    at once (nccl's ``Work.wait()``), so the host does not stop for the GPU; results
    are then ready for work queued later on that stream. A dead peer is caught by the
    backend's own watchdog (nccl's, with the group's timeout), not by this handle. A
    wait with an explicit ``timeout`` still blocks the host until done.
    """

    __slots__ = (
        "_test", "_finish", "_block", "_ordered", "_what", "_timeout_s", "_done", "_result",
    )  # fmt: skip

    def __init__(
        self,
        test: Callable[[], bool],
        finish: Callable[[], Any],
        *,
        what: str,
        timeout_s: float,
        block: Callable[[float], None] | None = None,
        ordered: Callable[[], None] | None = None,
    ) -> None:
        self._test = test
        self._finish = finish
        self._block = block
        self._ordered = ordered
        self._what = what
        self._timeout_s = timeout_s
        self._done = False
        self._result: Any = None

    @classmethod
    def completed(cls, result: Any, what: str = "local") -> Handle:
        h = cls(lambda: True, lambda: result, what=what, timeout_s=1.0)
        h._done, h._result = True, result
        return h

    def is_completed(self) -> bool:
        return self._done or self._test()

    @property
    def stream_ordered(self) -> bool:
        """Whether ``wait()`` without a timeout orders the device stream instead of
        blocking the host (see the class docstring)."""
        return self._ordered is not None

    def wait(self, timeout: float | None = None) -> Any:
        """Block until done (at most ``timeout`` s, default the group's); return the result.

        A stream-ordered handle waited without ``timeout`` returns once its result is
        ordered on the current stream (see the class docstring).
        """
        if self._done:
            return self._result
        if timeout is None and self._ordered is not None:
            self._ordered()
        else:
            limit = self._timeout_s if timeout is None else float(timeout)
            if self._block is not None:
                self._block(limit)
            elif not self._test():
                self._spin(limit)
        self._result = self._finish()
        self._done = True
        self._test = self._finish = _never  # drop references to buffers
        self._block = self._ordered = None
        return self._result

    def _spin(self, limit: float) -> None:
        # Poll without sleeping: MPI (and gloo's progress on some paths) only moves
        # data while we call into it, so a sleep here would stall big transfers.
        # After a short busy phase (what MPI's own blocking wait does), sched_yield
        # keeps an oversubscribed machine (4 ranks on 2 cores) moving; yielding from
        # the start would cost short operations a scheduler round trip.
        deadline = time.monotonic() + limit
        test = self._test
        n = 0
        while not test():
            n += 1
            if n & 63 == 0:
                if time.monotonic() > deadline:
                    raise timeout_error(self._what, limit)
                if n > _BUSY_POLLS:
                    os.sched_yield()


def timeout_error(what: str, limit: float) -> CommTimeoutError:
    return CommTimeoutError(
        f"{what} did not complete within {limit:g} s; a peer may have died or not "
        "called the same operation"
    )


def _never() -> Any:  # pragma: no cover - placeholder after completion
    raise AssertionError("handle already finished")
