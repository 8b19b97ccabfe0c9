"""The in-process store: tables as tensors in this process's memory.

It is the embedded default (no servers) and the reference every other store is
tested against. All work is vectorised (:mod:`ps.local.table`): ``torch.unique``
to coalesce duplicate ids, ``index_add_`` to sum their gradients, index gathers
and scatters for rows, state and clocks, a batched hash index for dynamic tables;
nothing loops over ids in Python. Batched requests of fixed tables are served whole
by the MPI server's C passes (:mod:`ps.local.batched_pass`).
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from comm import Handle
from comm.device import exact_device
from ps.checkpoint import TablePart, read_checkpoint, write_checkpoint
from ps.errors import check_existing
from ps.group_requests import GroupPull, GroupPush, GroupWrite, sorted_push
from ps.local.batched_pass import LocalBatchedPass
from ps.local.table import LocalTable
from ps.store import PullRequest, PullResult, PushRequest, Store, WriteRequest, check_requests
from ps.table import TableSpec
from ps.validate import (
    check_counted,
    check_grads,
    check_ids,
    check_pull_bound,
    check_write,
    unknown_table,
)

#: Rows per checkpoint part file (bounds the size of one ``.npy``).
PART_ROWS = 1 << 20


class InProcessStore(Store):
    """Tables held as CPU tensors; requests complete immediately.

    Thread-safe: every request holds its table's lock, so concurrent pushes to
    one table are applied one after the other and a pull sees rows and clocks
    of one moment. :meth:`request_counts` counts calls: a batched request is one.

    ``init_device`` (a ``torch.device`` or its name, e.g. ``"cuda"``): where the
    initial rows of new fixed tables (and of rows a checkpoint lacks) are hashed
    before they are copied into host memory: the same bits as the default (None:
    numpy on one host core, ~0.8 s per 65,536 x 128 rows, ~10 minutes for 26 x 2 M x
    128), the host's share with a GPU being one copy of the rows on every core. The
    tables stay on the host either way.

    Takes counted pushes (:class:`ps.PushRequest` ``counts``, ``stats``) and writes
    (:class:`ps.WriteRequest`).
    """

    counted_pushes = True
    value_writes = True

    def __init__(self, *, init_device: torch.device | str | None = None) -> None:
        self.init_device: torch.device | None = None
        if init_device is not None:
            if not isinstance(init_device, str | torch.device):
                raise TypeError(
                    f"InProcessStore: init_device must be None, a torch.device or a device "
                    f"name such as 'cuda', got {type(init_device).__name__} {init_device!r}"
                )
            try:
                self.init_device = exact_device(init_device)
            except (RuntimeError, TypeError) as e:
                raise ValueError(
                    f"InProcessStore: init_device={init_device!r} is not a usable torch "
                    f"device ({e}); expected None, 'cpu', 'cuda' or 'cuda:N'"
                ) from None
        self._tables: dict[str, LocalTable] = {}
        self._create_lock = threading.Lock()
        self._messages = {"pull_messages": 0, "push_messages": 0}
        self._batched = LocalBatchedPass()  # pull_many / push_many of fixed tables in C

    def __repr__(self) -> str:
        return f"InProcessStore(tables={list(self._tables)})"

    # ------------------------------------------------------------ tables

    def create_table(self, spec: TableSpec, *, exist_ok: bool = False) -> None:
        """Create ``spec.name``; see :meth:`ps.Store.create_table` for ``exist_ok``."""
        if not isinstance(spec, TableSpec):
            raise TypeError(f"create_table: expected a ps.TableSpec, got {type(spec).__name__}")
        with self._create_lock:
            old = self._tables.get(spec.name)
            where, clear = "in the in-process store", "or open a new InProcessStore"
            old_spec = None if old is None else old.spec
            if check_existing(old_spec, spec, exist_ok=exist_ok, where=where, clear=clear):
                self._tables[spec.name] = LocalTable(spec, init_device=self.init_device)
                self._batched.reset()

    def drop_table(self, table: str) -> None:
        with self._create_lock:
            self._get(table)  # unknown table: ValueError naming the known ones
            del self._tables[table]
            self._batched.reset()

    def tables(self) -> list[str]:
        return list(self._tables)

    def spec(self, table: str) -> TableSpec:
        return self._get(table).spec

    def _get(self, table: str) -> LocalTable:
        try:
            return self._tables[table]
        except (KeyError, TypeError):
            raise unknown_table(table, self._tables) from None

    # ------------------------------------------------------------ rows

    def pull_async(
        self,
        table: str,
        ids: torch.Tensor,
        *,
        clocks: torch.Tensor | None = None,
        bound: int | None = None,
    ) -> Handle:
        pull = self._checked_pull(PullRequest(table, ids, clocks, bound))
        self._messages["pull_messages"] += 1
        return Handle.completed(self._apply_pull(*pull), what=f"pull {table!r}")

    def push_async(self, table: str, ids: torch.Tensor, grads: torch.Tensor) -> Handle:
        push = self._checked_push(PushRequest(table, ids, grads))
        self._messages["push_messages"] += 1
        self._apply_push(*push)
        return Handle.completed(None, what=f"push {table!r}")

    def pull_many_async(self, requests: Sequence[PullRequest]) -> Handle:
        """Every table's pull is checked first, then applied in order (one message):
        fixed tables' in one C pass where it can serve them, else part by part."""
        requests = check_requests(requests, PullRequest, "pull_many")
        got = self._batched.pull([self._get(r.table) for r in requests], requests)
        if got is None:
            pulls = [self._checked_pull(r) for r in requests]
            got = [self._apply_pull(*p) for p in pulls]
        self._messages["pull_messages"] += bool(requests)
        return Handle.completed(got, what="pull_many")

    def push_many_async(self, requests: Sequence[PushRequest]) -> Handle:
        """Every table's push is checked first (nothing changes if one is bad), then
        applied in order (one message): fixed row-wise Adagrad tables' in one C pass
        where it can apply them, else part by part."""
        requests = check_requests(requests, PushRequest, "push_many")
        if self._batched.push([self._get(r.table) for r in requests], requests):
            self._messages["push_messages"] += 1
            return Handle.completed(None, what="push_many")
        pushes = [self._checked_push(r) for r in requests]
        self._messages["push_messages"] += bool(pushes)
        for p in pushes:
            self._apply_push(*p)
        return Handle.completed(None, what="push_many")

    def write_many_async(self, requests: Sequence[WriteRequest]) -> Handle:
        """Every table's write is checked first (nothing changes if one is bad), then
        applied in order under its table's lock (one message)."""
        requests = check_requests(requests, WriteRequest, "write_many")
        tables = [self._get(r.table) for r in requests]
        for t, r in zip(tables, requests, strict=True):
            check_write(t.spec, r.ids, r.rows, r.state, r.clocks)
        for t, r in zip(tables, requests, strict=True):
            with t.lock:
                t.write(r.ids, r.rows.detach(), r.state.detach(), r.clocks)
        self._messages["push_messages"] += bool(requests)
        return Handle.completed(None, what="write_many")

    def write_groups_async(self, requests: Sequence[WriteRequest | GroupWrite]) -> Handle:
        """A lone group write is applied whole by one C pass (its checks vectorised over
        every table's part); anything else, or what that pass does not take (it says
        nothing of why: the per-table path raises the error), goes the base class's way."""
        if isinstance(requests, Sequence) and len(requests) == 1:
            (r,) = requests
            if isinstance(r, GroupWrite):
                tables = [self._get(name) for name in r.space.names]
                if self._batched.write_group(tables, r):
                    self._messages["push_messages"] += 1
                    return Handle.completed(None, what="write_groups")
        return super().write_groups_async(requests)

    def pull_groups_async(self, requests: Sequence[PullRequest | GroupPull]) -> Handle:
        """A lone group request is served whole by the batched C pass (one message, no
        per-table request); anything else, or what that pass cannot serve, goes the
        base class's way (one ``pull_many`` of the tables' requests)."""
        if isinstance(requests, Sequence) and len(requests) == 1:
            (r,) = requests
            if isinstance(r, GroupPull):
                tables = [self._get(name) for name in r.space.names]
                got = self._batched.pull_group(tables, r)
                if got is not None:
                    self._messages["pull_messages"] += 1
                    return Handle.completed([got], what="pull_groups")
        return super().pull_groups_async(requests)

    def push_groups_async(self, requests: Sequence[PushRequest | GroupPush]) -> Handle:
        """A lone group push is applied whole by the batched C pass (its ids sorted
        first); anything else, or what that pass cannot apply, goes the base class's way
        (one ``push_many`` of the tables' pushes)."""
        if isinstance(requests, Sequence) and len(requests) == 1:
            (r,) = requests
            if isinstance(r, GroupPush):
                tables = [self._get(name) for name in r.space.names]
                if self._batched.push_group(tables, sorted_push(r)):
                    self._messages["push_messages"] += 1
                    return Handle.completed(None, what="push_groups")
        return super().push_groups_async(requests)

    def _checked_pull(
        self, r: PullRequest
    ) -> tuple[LocalTable, torch.Tensor, torch.Tensor | None, int | None, bool]:
        t = self._get(r.table)
        ids = check_ids(t.spec, r.ids, "pull").cpu()
        return t, ids, check_pull_bound(t.spec, ids, r.clocks, r.bound), r.bound, r.with_state

    @staticmethod
    def _apply_pull(
        t: LocalTable,
        ids: torch.Tensor,
        clocks: torch.Tensor | None,
        bound: int | None,
        with_state: bool = False,
    ) -> PullResult:
        with t.lock:  # rows, clocks (and state) of one consistent moment
            got = t.pull(ids, clocks, bound)
            if not with_state:
                return got
            back = ids if got.positions is None else ids[got.positions]
            return dataclasses.replace(got, state=t.read_state(back))

    def _checked_push(self, r: PushRequest) -> tuple[LocalTable, torch.Tensor, torch.Tensor, Any]:
        t = self._get(r.table)
        ids = check_ids(t.spec, r.ids, "push").cpu()
        finite = t.spec.nan_policy == "raise"
        grads = check_grads(t.spec, ids, r.grads, finite=finite).detach().cpu()
        counted = check_counted(t.spec, ids, r.counts, r.stats, takes=True, where="this store")
        return t, ids, grads, counted

    @staticmethod
    def _apply_push(
        t: LocalTable,
        ids: torch.Tensor,
        grads: torch.Tensor,
        counted: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        with t.lock:
            t.push(ids, grads, checked=t.spec.nan_policy == "raise", counted=counted)

    def request_counts(self) -> dict[str, int]:
        return {**self._messages, "servers": 1}

    # ------------------------------------------------------------ inspection

    def clocks(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        t = self._get(table)
        ids = check_ids(t.spec, ids, "clocks").cpu()
        with t.lock:
            return t.read_clocks(ids)

    def state(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        t = self._get(table)
        ids = check_ids(t.spec, ids, "state").cpu()
        with t.lock:
            return t.read_state(ids)

    def stats(self) -> dict[str, dict[str, int | float]]:
        out = {}
        for name, t in list(self._tables.items()):
            with t.lock:
                out[name] = t.stats()
        return out

    # ------------------------------------------------------------ checkpoints

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write all tables to the checkpoint folder ``path`` (atomic; see :mod:`ps.checkpoint`).

        Each table is written while holding its lock, so it is saved as of one
        moment; different tables may be saved at different moments if other
        threads push meanwhile.
        """

        def parts_locked(t: LocalTable) -> Iterator[TablePart]:
            with t.lock:
                yield from t.parts(PART_ROWS)

        tables = [(t.spec, parts_locked(t)) for t in list(self._tables.values())]
        write_checkpoint(path, tables, writer=type(self).__name__)

    def load(self, path: str | os.PathLike[str]) -> None:
        """Replace (or create) every table of the checkpoint at ``path`` with its rows.

        Everything is read and checked first; tables change only if all of it is
        good. Eviction ages of dynamic tables restart at the load.
        """
        ckpt = read_checkpoint(path)
        loaded = {
            spec.name: LocalTable.from_part(spec, ckpt.read_table(spec.name), self.init_device)
            for spec in ckpt.specs
        }
        with self._create_lock:
            self._tables.update(loaded)
            self._batched.reset()
