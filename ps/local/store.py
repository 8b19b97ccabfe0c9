"""The in-process store: tables as tensors in this process's memory.

It is the embedded default (no servers) and the reference every other store is
tested against. All work is vectorised (:mod:`ps.local.table`): ``torch.unique``
to coalesce duplicate ids, ``index_add_`` to sum their gradients, index gathers
and scatters for rows, state and clocks, a batched hash index for dynamic tables;
nothing loops over ids in Python.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import torch

from comm import Handle
from ps.checkpoint import TablePart, read_checkpoint, write_checkpoint
from ps.errors import check_existing
from ps.local.table import LocalTable
from ps.store import PullResult, Store
from ps.table import TableSpec
from ps.validate import check_grads, check_ids, check_pull_bound, unknown_table

#: Rows per checkpoint part file (bounds the size of one ``.npy``).
PART_ROWS = 1 << 20


class InProcessStore(Store):
    """Tables held as CPU tensors; requests complete immediately.

    Thread-safe: every request holds its table's lock, so concurrent pushes to
    one table are applied one after the other and a pull sees rows and clocks
    of one moment.
    """

    def __init__(self) -> None:
        self._tables: dict[str, LocalTable] = {}
        self._create_lock = threading.Lock()

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
                self._tables[spec.name] = LocalTable(spec)

    def drop_table(self, table: str) -> None:
        with self._create_lock:
            self._get(table)  # unknown table: ValueError naming the known ones
            del self._tables[table]

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
        t = self._get(table)
        ids = check_ids(t.spec, ids, "pull").cpu()
        caller_clocks = check_pull_bound(t.spec, ids, clocks, bound)
        with t.lock:  # rows and clocks of one consistent moment
            result: PullResult = t.pull(ids, caller_clocks, bound)
        return Handle.completed(result, what=f"pull {table!r}")

    def push_async(self, table: str, ids: torch.Tensor, grads: torch.Tensor) -> Handle:
        t = self._get(table)
        ids = check_ids(t.spec, ids, "push").cpu()
        finite = t.spec.nan_policy == "raise"
        grads = check_grads(t.spec, ids, grads, finite=finite).detach().cpu()
        with t.lock:
            t.push(ids, grads, checked=finite)
        return Handle.completed(None, what=f"push {table!r}")

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
            spec.name: LocalTable.from_part(spec, ckpt.read_table(spec.name)) for spec in ckpt.specs
        }
        with self._create_lock:
            self._tables.update(loaded)
