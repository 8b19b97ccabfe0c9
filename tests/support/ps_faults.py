"""Fault injection for the stores' exactly-once tests: test-only subclasses of the real
stores and servers, so the product constructors carry no test switches.

* :class:`LossyRedisStore` - a :class:`ps.RedisStore` that acts as if the replies of every
  ``drop_reply_every``-th push batch were lost after Redis ran the scripts (the resend
  path then runs for real), and with ``exactly_once=False`` sends its pushes without
  sequence numbers (the control: a resent push is applied again);
* :func:`unnumbered_mpi_store` - a :class:`ps.MPIStore` whose pushes carry no sequence
  numbers (the control for the MPI store);
* :func:`serve_mpi_lossy` - :func:`ps.serve_mpi` with a server loop that applies
  every push but does not send the reply of every ``drop_reply_every``-th one (at most
  once per request: a resend is answered).

Everything else is the real code: the subclasses override the stores' own methods (the
Redis store's reply loop, the MPI server loop), no hook kept for tests.
"""

from __future__ import annotations

from typing import Any

import comm
from ps.redis.conn import RedisUnavailableError
from ps.redis.store import RedisStore


def _every(name: str, k: object) -> int:
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise ValueError(f"{name} must be an int >= 0, got {k!r}")
    return k


class LossyRedisStore(RedisStore):
    """:class:`RedisStore` with lost push replies and, optionally, no sequence numbers."""

    def __init__(
        self, *args: Any, drop_reply_every: int = 0, exactly_once: bool = True, **kwargs: Any
    ) -> None:
        if not isinstance(exactly_once, bool):
            raise TypeError(f"exactly_once must be a bool, got {exactly_once!r}")
        self._drop_every = _every("drop_reply_every", drop_reply_every)
        super().__init__(*args, **kwargs)
        self._batches = 0  # push batches answered (first sends)
        if not exactly_once:
            self._wid = b""  # the push scripts then record and check no numbers

    def _replies(
        self,
        batch: Any,
        cmds: list[Any],
        what: str,
        limit: float | None,
        push: list[Any] | None = None,
        label: str | None = None,
    ) -> list[Any]:
        """The store's own reply loop; every ``drop_reply_every``-th push batch (a first
        send or a second round; resends start their own batch and are answered) loses its
        replies once the scripts ran, so the loop's resend path runs."""
        if push is not None and self._drop_every:
            with self._lock:
                self._batches += 1
                drop = self._batches % self._drop_every == 0
            if drop:
                try:
                    written = batch if batch is not None else self._link.start(cmds, what, label)
                except RedisUnavailableError:
                    written = None  # not written: the loop writes it (no reply to lose)
                if written is not None:
                    batch = _LostReplies(written, what, self._drop_every)
        return super()._replies(batch, cmds, what, limit, push, label)


class _LostReplies:
    """A written batch whose replies are read (so its scripts ran) and then lost."""

    def __init__(self, batch: Any, what: str, every: int) -> None:
        self.batch, self.what, self.every = batch, what, every

    def finish(self, limit_s: float | None = None) -> list[Any]:
        self.batch.finish(limit_s)
        raise RedisUnavailableError(
            f"{self.what}: reply dropped on purpose after the scripts ran "
            f"(LossyRedisStore drop_reply_every={self.every})"
        )


def _mpi() -> tuple[Any, Any]:
    # Imported on first use: mpi4py starts MPI, and the Redis tests need none.
    from ps.mpi.server import ShardServer
    from ps.mpi.store import MPIStore

    return ShardServer, MPIStore


def unnumbered_mpi_store(group: comm.ProcessGroup, topology: comm.Topology, **kwargs: Any) -> Any:
    """An :class:`ps.MPIStore` whose pushes carry no sequence numbers."""
    _server, mpi_store = _mpi()

    class UnnumberedMPIStore(mpi_store):  # type: ignore[misc, valid-type]
        _sequenced = False

    return UnnumberedMPIStore(group, topology, **kwargs)


def serve_mpi_lossy(
    group: comm.ProcessGroup, topology: comm.Topology, config: Any = None, *, drop_reply_every: int
) -> dict[str, dict[str, int | float]]:
    """:func:`ps.serve_mpi` with the reply of every ``drop_reply_every``-th applied push not
    sent (the push is applied; a resend of the same request is answered)."""
    shard_server, _store = _mpi()
    every = _every("drop_reply_every", drop_reply_every)

    class LossyShardServer(shard_server):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.applied = 0
            self.dropped: set[tuple[int, int]] = set()  # (worker, request id)

        def reply_lost(self, src: int, request_id: int) -> bool:
            self.applied += 1
            if every and self.applied % every == 0 and (src, request_id) not in self.dropped:
                self.dropped.add((src, request_id))
                return True
            return False

    stats: dict[str, dict[str, int | float]] = LossyShardServer.open(
        group, topology, config
    ).serve()
    return stats
