"""Exactly-once bookkeeping of one Redis client: push sequence numbers and push completion.

The protocol (numbers per (table, bucket), the watermark, what the push script records
and how a repeat is acknowledged) is described in ``docs/ps_protocol.md``; this module
holds the client's side of it:

* :class:`PushNumbers` - one table's numbers: those of a push's calls and the watermark
  sent with each (every call numbered up to it has been answered, so the script may
  forget them);
* :class:`PushSettle` - completes one push exactly once (its replies, its second round
  for rows missing from Redis, eviction, counters), from its own ``wait()`` or from a
  later request of the same client, so that one client's requests apply in issue order.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class PushNumbers:
    """One table's push numbers at this client, per bucket: the last number given out
    (``last``, ``[B]``) and the numbers whose calls have no answer yet (``unanswered``,
    ``[B]`` sets). The caller of each method holds the store's lock."""

    last: list[int]
    unanswered: list[set[int]]

    @classmethod
    def fresh(cls, buckets: int) -> PushNumbers:
        return cls(last=[0] * buckets, unanswered=[set() for _ in range(buckets)])

    def take(self, buckets: list[int]) -> list[tuple[int, int]]:
        """A sequence number per call to ``buckets``, each with its watermark (every call
        of this client to the bucket numbered up to it has been answered)."""
        out = []
        for b in buckets:
            seq = self.last[b] = self.last[b] + 1
            self.unanswered[b].add(seq)
            out.append((seq, min(self.unanswered[b]) - 1))
        return out

    def answered(self, calls: list[tuple[int, int, int]], seqs: list[tuple[int, int]]) -> None:
        """Calls ``(bucket, lo, hi)`` numbered ``seqs`` have their answers (or failed for
        good)."""
        for (b, _lo, _hi), (seq, _mark) in zip(calls, seqs, strict=True):
            self.unanswered[b].discard(seq)


class PushSettle:
    """Completes one push (one table's, or a batch of several tables') once: reads its
    replies, sends its second round (rows missing from Redis), evicts, counts. Called by
    the push's own ``wait()`` and by every later request of the same client on one of
    its tables (:meth:`RedisStore._settle`)."""

    __slots__ = ("run", "order", "lock", "done", "error", "second")

    def __init__(self, run: Any, order: int) -> None:
        self.run = run  # run(limit) -> True if a second round was sent
        self.order = order  # the store's issue counter: settle in increasing order
        self.lock = threading.Lock()
        self.done = False
        self.error: BaseException | None = None
        self.second = False

    def __call__(self, limit: float | None) -> bool:
        """Complete the push (at most once); True if it sent a second round."""
        with self.lock:
            if not self.done:
                try:
                    self.second = bool(self.run(limit))
                except BaseException as err:
                    self.error = err
                finally:
                    self.done = True
                    self.run = None  # drop the closure (it holds the request's buffers)
            if self.error is not None:
                raise self.error
            return self.second
