"""The interface every parameter-server store speaks.

A store holds named tables of float32 rows. Workers *pull* rows by id and *push*
row gradients; the store applies the table's optimizer (see
:mod:`ps.optimizers`) and counts, per row, how many updates it applied (the
row's *clock*). Caches compare clocks to bound staleness.

Push semantics (all stores):

* gradients of ids that repeat within one push are **summed first**; the
  optimizer then runs **once per unique row**, and each touched row's clock goes
  up by exactly 1;
* a push is atomic per table: the request is validated before anything changes,
  so a bad request (unknown table, bad ids, wrong shape, NaN/Inf) raises and
  leaves rows, optimizer state and clocks as they were (with the table's
  ``nan_policy="skip"``, rows whose summed gradient is not finite are dropped
  and the rest is applied);
* a *counted* push (:class:`PushRequest` with ``counts``) stands for ``counts[i]``
  updates of its row at once, with the statistic the optimizer needs
  (:mod:`ps.optimizers`); the row's clock still goes up by 1 (it counts pushes).
  Stores with :attr:`Store.counted_pushes` take them; the others refuse them;
* on a dynamic table (``TableSpec.num_rows`` None) a push creates the rows it
  touches that do not exist yet (from the table's initializer, clock 0) before
  applying the optimizer.

Write semantics (stores with :attr:`Store.value_writes`): a *write*
(:class:`WriteRequest`) sets rows, their optimizer state and their clocks to the values
it carries, for distinct ids of a fixed float32 table, checked whole before anything
changes (finite rows and state, clocks >= 0). No optimizer runs. It is what a cache
that is its tables' only writer sends instead of gradient sums: its copies already took
every update, in order, with the table's optimizer, so the store need not step them
again (``cache.CacheConfig.write_back``).

Pull semantics (all stores):

* ``pull(table, ids)`` returns every row, in the order of ``ids`` (duplicates
  allowed), with ``positions`` None;
* ``pull(table, ids, clocks=c, bound=b)`` is the HET conditional pull: ``c``
  ``[N]`` int64 are the clocks of the copies the caller holds, and only rows
  whose store clock is ``> c + b`` come back; ``positions`` ``[M]`` int64 (in
  increasing order) says which entries of ``ids`` they are;
* a pull never creates rows: an id of a dynamic table without a row reads as
  its initial row with clock 0 (what a push would start it from);
* a :class:`PullRequest` with ``with_state`` also returns the optimizer state of
  the rows it returns (``PullResult.state``), as of the same moment: what a cache
  whose copies step by the table's optimizer installs with the rows. The in-process
  store reads it with the rows, Redis in the same pipelined round trip, the MPI
  store by state messages sent right behind the pull's; the base class reads it
  right after the pull (:meth:`Store.state_many`), before anything else is sent;
* on a dynamic table a pull *touches* every requested row that exists (returned
  or not): it counts as recent use for LRU (``capacity``) and age
  (``max_age_steps``) eviction, see :class:`ps.table.TableSpec`.

Optimizers are lazy (:mod:`ps.optimizers`): rows not in a push do not change.

Statistics: :meth:`Store.stats` gives per table the counters named in
:data:`STAT_KEYS` (stores may add more).

Tables: :meth:`Store.create_table` (``exist_ok`` for shared stores, where every
worker may call it) and :meth:`Store.drop_table`; the errors are in :mod:`ps.errors`.

Checkpoints: :meth:`Store.save` / :meth:`Store.load` use the directory format of
:mod:`ps.checkpoint` (JSON manifest + ``.npy`` parts carrying row ids, no
pickle), so any store with any number of shards loads what any other saved.

Batched requests: :meth:`Store.pull_many_async` / :meth:`Store.push_many_async`
carry one step's work for several tables, applied in the order given, each with the
per-table semantics above. The stores here (in-process, MPI, Redis, the cache) check
every table's request before any is sent (a bad one raises and nothing changes) and
send all of a step's work for one server in one message (MPI) or one pipelined round
trip (Redis), which :meth:`Store.request_counts` counts. The base class, for other
stores, issues them one table at a time. :meth:`Store.pull_groups_async` /
:meth:`Store.push_groups_async` take, beside them, requests over several tables
addressed as one id space (:mod:`ps.group_requests`: what a cache shared by tables
sends).

Every request has an ``*_async`` form returning a :class:`comm.Handle`; the
synchronous form is ``*_async(...).wait()``. Requests are validated when they
are issued, so a bad one raises from the ``*_async`` call itself. The in-process
store completes at once; remote stores (MPI, Redis) return handles for requests
in flight.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from comm import Handle
from ps.table import TableSpec

if TYPE_CHECKING:
    from ps.group_requests import GroupPull, GroupPush, GroupWrite

#: Counters every store reports per table in :meth:`Store.stats`.
STAT_KEYS: tuple[str, ...] = (
    "rows",  # rows held (fixed: num_rows; dynamic: rows that exist now)
    "bytes",  # bytes of weights + optimizer state + clocks held
    "pull_requests",  # pull requests served
    "rows_pulled",  # rows returned by pulls
    "rows_skipped_by_bound",  # rows a conditional pull did not return (fresh enough)
    "push_requests",  # push requests applied
    "rows_pushed",  # unique rows the optimizer was applied to
)


@dataclass(slots=True, frozen=True)
class PullResult:
    """Rows as of the pull.

    ``rows`` float32 ``[M, D]`` and ``clocks`` int64 ``[M]``. A plain pull
    returns all ``M = N`` requested rows in order and ``positions`` is None; a
    conditional pull returns only the stale rows and ``positions`` int64 ``[M]``
    (increasing) are their indices into the request's ``ids``. ``state`` float32
    ``[M, state_dim]``: the returned rows' optimizer state, for a request
    ``with_state`` (else None).
    """

    rows: torch.Tensor
    clocks: torch.Tensor
    positions: torch.Tensor | None = None
    state: torch.Tensor | None = None


@dataclass(slots=True, frozen=True)
class PullRequest:
    """One table's part of a batched pull: ``ids`` int64 ``[N]``; with ``clocks``
    int64 ``[N]`` and ``bound`` a conditional pull (see :meth:`Store.pull_async`);
    ``with_state``: the returned rows' optimizer state too (``PullResult.state``)."""

    table: str
    ids: torch.Tensor
    clocks: torch.Tensor | None = None
    bound: int | None = None
    with_state: bool = False


@dataclass(slots=True, frozen=True)
class PushRequest:
    """One table's part of a batched push: ``grads`` float32 ``[N, D]`` for ``ids`` ``[N]``.

    A counted push (a cache under a write bound) adds ``counts`` int64 ``[N]`` (>= 1:
    the updates each row's gradient sums) and ``stats`` float32 ``[N, Q]``, ``Q`` the
    optimizer's :meth:`ps.Optimizer.stat_dim` (the sums of the squares it needs)."""

    table: str
    ids: torch.Tensor
    grads: torch.Tensor
    counts: torch.Tensor | None = None
    stats: torch.Tensor | None = None


@dataclass(slots=True, frozen=True)
class WriteRequest:
    """One table's part of a batched write: ``rows`` float32 ``[N, D]``, ``state`` float32
    ``[N, S]`` (``S`` the optimizer's ``state_dim``) and ``clocks`` int64 ``[N]`` of the
    distinct ``ids`` ``[N]`` replace the store's (see the module docstring)."""

    table: str
    ids: torch.Tensor
    rows: torch.Tensor
    state: torch.Tensor
    clocks: torch.Tensor


#: Keys of :meth:`Store.request_counts`.
REQUEST_KEYS: tuple[str, ...] = (
    "pull_messages",  # pull messages (or round trips) the servers received, all tables
    "push_messages",  # push messages (or round trips) the servers received, all tables
    "servers",  # servers (shards, nodes) the counts are summed over
)


class Store(ABC):
    """A set of tables of rows; see the module docstring for push semantics."""

    #: Whether pushes may be counted (:class:`PushRequest` ``counts`` and ``stats``).
    counted_pushes: bool = False
    #: Whether the store takes writes of rows, state and clocks (:class:`WriteRequest`).
    value_writes: bool = False

    # ------------------------------------------------------------ tables

    @abstractmethod
    def create_table(self, spec: TableSpec, *, exist_ok: bool = False) -> None:
        """Create ``spec.name`` with its initial rows.

        If the table exists: with an equal spec, ``exist_ok=True`` opens it and
        ``exist_ok=False`` raises :class:`ps.TableExistsError`; with another spec
        :class:`ps.TableSpecMismatch` is raised whatever ``exist_ok`` (naming both
        shapes). On a shared store (MPI, Redis) any number of workers may call it
        with ``exist_ok=True`` at the same moment: one creates, all succeed.
        """

    @abstractmethod
    def drop_table(self, table: str) -> None:
        """Delete ``table`` (rows, optimizer state, clocks, spec) for every client.

        An unknown table is a ValueError naming the tables there are.
        """

    @abstractmethod
    def tables(self) -> list[str]:
        """Names of the tables, in creation order."""

    @abstractmethod
    def spec(self, table: str) -> TableSpec:
        """The spec ``table`` was created with."""

    def num_rows(self, table: str) -> int | None:
        """``spec(table).num_rows``: None for a dynamic table (see ``stats()`` for its size)."""
        return self.spec(table).num_rows

    # ------------------------------------------------------------ rows

    @abstractmethod
    def pull_async(
        self,
        table: str,
        ids: torch.Tensor,
        *,
        clocks: torch.Tensor | None = None,
        bound: int | None = None,
    ) -> Handle:
        """Start a pull of rows ``ids`` (int64 ``[N]``); ``wait()`` gives a :class:`PullResult`.

        With ``clocks`` (int64 ``[N]``, the caller's copies) and ``bound`` (int >= 0)
        together, only rows whose store clock is ``> clocks + bound`` are returned,
        with their ``positions``. Giving one without the other is a ValueError.
        """

    def pull(
        self,
        table: str,
        ids: torch.Tensor,
        *,
        clocks: torch.Tensor | None = None,
        bound: int | None = None,
    ) -> PullResult:
        """``pull_async(...).wait()``."""
        result: PullResult = self.pull_async(table, ids, clocks=clocks, bound=bound).wait()
        return result

    @abstractmethod
    def push_async(self, table: str, ids: torch.Tensor, grads: torch.Tensor) -> Handle:
        """Start a push of ``grads`` float32 ``[N, D]`` for rows ``ids`` int64 ``[N]``.

        ``wait()`` returns None once the update is applied.
        """

    def push(self, table: str, ids: torch.Tensor, grads: torch.Tensor) -> None:
        self.push_async(table, ids, grads).wait()

    def pull_many_async(self, requests: Sequence[PullRequest]) -> Handle:
        """Start the pulls of several tables at once; ``wait()`` gives one
        :class:`PullResult` per request, in order.

        The base class issues one request per table (a bad one raises after the ones
        before it were sent); the stores here check them all first and send each
        server its share of all of them in one message (see the module docstring).
        """
        reqs = check_requests(requests, PullRequest, "pull_many")
        handles = [self.pull_async(r.table, r.ids, clocks=r.clocks, bound=r.bound) for r in reqs]
        return _with_state_after(self, reqs, _all_of(handles, "pull_many"))

    def pull_many(self, requests: Sequence[PullRequest]) -> list[PullResult]:
        """``pull_many_async(...).wait()``."""
        result: list[PullResult] = self.pull_many_async(requests).wait()
        return result

    def push_many_async(self, requests: Sequence[PushRequest]) -> Handle:
        """Start the pushes of several tables at once; ``wait()`` returns None once
        every one is applied, in order. The stores here check them all before any is
        sent; the base class pushes one table at a time (and refuses counted pushes,
        which ``push_async`` cannot carry)."""
        reqs = check_requests(requests, PushRequest, "push_many")
        for r in reqs:
            if r.counts is not None or r.stats is not None:
                raise ValueError(
                    f"push table {r.table!r}: {type(self).__name__} does not take counted "
                    "pushes (counts, stats)"
                )
        handles = [self.push_async(r.table, r.ids, r.grads) for r in reqs]
        return _all_of(handles, "push_many", result=False)

    def push_many(self, requests: Sequence[PushRequest]) -> None:
        self.push_many_async(requests).wait()

    def pull_groups_async(self, requests: Sequence[PullRequest | GroupPull]) -> Handle:
        """:meth:`pull_many_async` where a request may also be a
        :class:`ps.group_requests.GroupPull` (every table of an id space at once, by
        packed ids); ``wait()`` gives one :class:`PullResult` per request, a group's over
        its packed ids. The base class cuts each group request into its tables' requests
        and sends everything as one :meth:`pull_many_async`; the in-process store serves
        a group request whole."""
        from ps.group_requests import pull_by_table  # (that module builds on this one)

        return pull_by_table(self, requests)

    def push_groups_async(self, requests: Sequence[PushRequest | GroupPush]) -> Handle:
        """:meth:`push_many_async` where a request may also be a
        :class:`ps.group_requests.GroupPush`; the base class cuts each group request into
        its tables' pushes and sends everything as one :meth:`push_many_async`."""
        from ps.group_requests import push_by_table  # (that module builds on this one)

        return push_by_table(self, requests)

    def write_many_async(self, requests: Sequence[WriteRequest]) -> Handle:
        """Start the writes of several tables at once (:class:`WriteRequest`, see the
        module docstring); ``wait()`` returns None once every one is applied, in order.
        Every request is checked before any is sent. Stores without
        :attr:`value_writes` refuse them."""
        raise NotImplementedError(
            f"{type(self).__name__} does not take writes of rows (value_writes is False)"
        )

    def write_many(self, requests: Sequence[WriteRequest]) -> None:
        """``write_many_async(...).wait()``."""
        self.write_many_async(requests).wait()

    def write_groups_async(self, requests: Sequence[WriteRequest | GroupWrite]) -> Handle:
        """:meth:`write_many_async` where a request may also be a
        :class:`ps.group_requests.GroupWrite`; the base class cuts each group write into
        its tables' writes and sends everything as one :meth:`write_many_async`; the
        in-process store applies a group write whole."""
        from ps.group_requests import write_by_table  # (that module builds on this one)

        return write_by_table(self, requests)

    # ------------------------------------------------------------ inspection

    def request_counts(self) -> dict[str, int]:
        """Messages the store's servers received so far, summed over the servers:
        the keys of :data:`REQUEST_KEYS`. A batched request counts once per server
        it reaches; the in-process store (one "server") counts calls."""
        raise NotImplementedError(f"{type(self).__name__} does not count its requests")

    @abstractmethod
    def clocks(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """Update counts of rows ``ids``: int64 ``[N]``."""

    @abstractmethod
    def state(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """Optimizer state of rows ``ids``: float32 ``[N, state_dim]`` (for tests, checkpoints).

        Like a pull, it creates nothing: a missing row of a dynamic table reads as
        the initial state.
        """

    def state_many(self, requests: Sequence[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        """:meth:`state` of every ``(table, ids)``, in order; a store whose requests can
        be in flight together sends them all before it waits (the base reads them one by
        one)."""
        return [self.state(table, ids) for table, ids in requests]

    @abstractmethod
    def stats(self) -> dict[str, dict[str, int | float]]:
        """Per table, at least the counters of :data:`STAT_KEYS` (a snapshot)."""

    # ------------------------------------------------------------ checkpoints

    @abstractmethod
    def save(self, path: str | os.PathLike[str]) -> None:
        """Write every table (rows, optimizer state, clocks) to the checkpoint directory ``path``.

        Atomic: a crash during save leaves the previous checkpoint at ``path``
        loadable (see :mod:`ps.checkpoint`).
        """

    @abstractmethod
    def load(self, path: str | os.PathLike[str]) -> None:
        """Replace the tables named in the checkpoint at ``path`` with its contents.

        A table that does not exist is created; an existing one is replaced
        entirely (spec included). Rows are routed by id, so the checkpoint may
        come from any store with any shard count. The checkpoint is read and
        checked before any table changes.
        """

    def close(self) -> None:  # noqa: B027 - optional; stores without resources keep it
        """Release connections or servers; the in-process store has nothing to release."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_requests(
    requests: Sequence[object], kind: type | tuple[type, ...], what: str
) -> list[Any]:
    """``requests`` as a list, each checked to be a ``kind`` (or one of the kinds)."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = " or ".join(f"ps.{k.__name__}" for k in kinds)
    if isinstance(requests, str | bytes) or not isinstance(requests, Sequence):
        raise TypeError(f"{what}: expected a sequence of {names}, got {type(requests).__name__}")
    out = list(requests)
    for i, r in enumerate(out):
        if not isinstance(r, kinds):
            raise TypeError(f"{what}: request {i} is a {type(r).__name__}, expected a {names}")
    return out


def _with_state_after(store: Store, requests: Sequence[PullRequest], batch: Handle) -> Handle:
    """``batch`` (the pulls of ``requests``), whose results gain the optimizer state of
    the rows they return where a request asks ``with_state``: read by ONE
    :meth:`Store.state_many` once the pulls have their replies (nothing else of those
    tables is sent in between, and a store applies one worker's requests in order, so
    the state matches the rows). ``batch`` itself where no request asks."""
    if not any(r.with_state for r in requests):
        return batch

    def finish() -> list[PullResult]:
        results: list[PullResult] = batch.wait()
        asks = [
            (i, r.table, r.ids if res.positions is None else r.ids[res.positions])
            for i, (r, res) in enumerate(zip(requests, results, strict=True))
            if r.with_state
        ]
        states = store.state_many([(table, ids) for _, table, ids in asks])
        out = list(results)
        for (i, _, _), state in zip(asks, states, strict=True):
            out[i] = dataclasses.replace(results[i], state=state)
        return out

    return after(batch, finish, "pull with state")


def first_of(batch: Handle, what: str) -> Handle:
    """The handle of a batch of one request: ``wait()`` gives its one result."""
    return after(batch, lambda: batch.wait()[0], what)


def after(batch: Handle, finish: Callable[[], Any], what: str) -> Handle:
    """A handle done when ``batch`` is, whose ``wait()`` gives ``finish()`` (which waits
    for ``batch`` itself and reads its result)."""
    return Handle(
        batch.is_completed,
        finish,
        what=what,
        timeout_s=math.inf,  # the batch's own handle applies its timeout
        block=lambda limit: batch.wait(None if math.isinf(limit) else limit),
    )


def _all_of(handles: list[Handle], what: str, *, result: bool = True) -> Handle:
    """One handle over ``handles``: done when all are; ``wait()`` gives their results
    in order (None with ``result=False``)."""
    if all(h.is_completed() for h in handles):
        done = [h.wait() for h in handles]  # raises what a request raised
        return Handle.completed(done if result else None, what=what)

    def test() -> bool:
        return all(h.is_completed() for h in handles)

    def block(limit: float) -> None:
        deadline = time.monotonic() + limit
        for h in handles:
            h.wait(max(0.0, deadline - time.monotonic()) if math.isfinite(limit) else None)

    def finish() -> Any:
        out = [h.wait() for h in handles]
        return out if result else None

    return Handle(test, finish, what=what, timeout_s=math.inf, block=block)
