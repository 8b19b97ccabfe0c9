"""The sparse step of hybrid tables on a background thread, beside the dense compute.

:class:`SparsePipeline` runs every store call of one :class:`embedding.hybrid.HybridTables`
on ONE worker thread, in the order they were submitted (a FIFO: the store sees exactly
the sequence of pulls and pushes the main thread asked for, so a store or cache that is
not thread-safe is used from one thread only). The main thread submits the next batch's
dedup and pull when the trainer announces it (``prefetch``), and each batch's push from
the backward, and goes on with the dense forward and backward meanwhile; it waits only
when it needs a result (the rows of the batch it is about to pool).

Why a thread and not a process: the store calls spend their time in C (the cache's
kernels and the store's kernels are ctypes calls, which release the GIL), in torch ops
(which release it too) or waiting on a socket (MPI, Redis), so they overlap with the
dense compute's torch ops; only their Python glue takes turns with the main thread.

Errors raised on the thread (a dead server, a NaN gradient, an unknown table: the
store's messages name the table) are raised again in the main thread by the first call
that needs what failed: :meth:`SparsePipeline.wait` for a result, :meth:`drain` before
anything reads the store directly (a flush, a checkpoint, a load).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class SparsePipeline:
    """One background thread running submitted store jobs in order (see the module
    docstring). ``submit(job)`` returns a ``Future``; a push's future is kept until
    :meth:`drain` or :meth:`check` reads it, so its error is never lost."""

    def __init__(self, name: str = "hybrid-sparse") -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._owed: deque[Future[Any]] = deque()  # fire-and-forget jobs (pushes), in order
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], Any]) -> Future[Any]:
        """Run ``job()`` after every job submitted before it."""
        return self._pool.submit(job)

    def submit_owed(self, job: Callable[[], Any]) -> None:
        """Run ``job()`` in order; its error is raised by the next :meth:`check` or
        :meth:`drain` (a push: nothing waits for its result)."""
        self.owe(self._pool.submit(job))

    def owe(self, future: Future[Any]) -> None:
        """Keep ``future``'s error for the next :meth:`check` or :meth:`drain`."""
        with self._lock:
            self._owed.append(future)

    def check(self) -> None:
        """Raise the first error of an owed job that has finished; forget the finished ones."""
        while True:
            with self._lock:
                if not self._owed or not self._owed[0].done():
                    return
                future = self._owed.popleft()
            future.result()  # raises the job's error here, in the caller's thread

    def drain(self) -> None:
        """Wait for every job submitted so far; raise the first owed job's error."""
        self._pool.submit(lambda: None).result()  # the FIFO: everything before it is done
        while True:
            with self._lock:
                if not self._owed:
                    return
                future = self._owed.popleft()
            future.result()

    def run(self, job: Callable[[], Any]) -> Any:
        """``job()`` on the thread after everything submitted before it; its result
        (owed errors first: what failed before comes first)."""
        future = self.submit(job)
        try:
            result = future.result()
        except BaseException:
            self.check()  # an earlier push's error first: it is what broke this job
            raise
        self.check()
        return result

    def close(self) -> None:
        """Finish what was submitted and stop the thread."""
        try:
            self.drain()
        finally:
            self._pool.shutdown(wait=True)
