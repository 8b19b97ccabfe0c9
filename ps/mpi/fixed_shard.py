"""One server's share of a fixed table when several servers split it.

Row ``id`` lives on server ``shard_of(id, S)``: a hash partition, so a server's rows
are scattered over the table's id range. Holding them like a dynamic table (a hash
index, rows created on first push) made every request go through the index and every
first touch build rows: measured with 2 servers on 26 tables of 20 000 rows, a step's
pull and push took 10.7 and 27 ms on each server against 2 and 2.6 ms for one server
holding the whole table. :class:`FixedShard` holds exactly the rows routed to it,
densely, in a fixed :class:`ps.local.table.LocalTable` of ``n_k`` rows, with an int32
map from the table's ids to local rows (4 bytes per table row, like the cache's dense
index): a request is one ``take`` of the map, then the fixed table's own paths.
Local rows follow the order of the ids, so sorted ids stay sorted.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import replace

import torch

from ps.checkpoint import TablePart
from ps.local.table import LocalTable
from ps.routing import shard_of
from ps.store import PullResult
from ps.table import TableSpec

_INIT_CHUNK = 1 << 20  # rows whose initial values are computed at once


class FixedShard:
    """The rows of fixed table ``spec`` that route to ``shard`` of ``num_shards``.

    The same methods as :class:`LocalTable` (what a server calls), on the table's ids
    (every id must route here: the server checks that before calling)."""

    def __init__(
        self, spec: TableSpec, shard: int, num_shards: int, part: TablePart | None = None
    ) -> None:
        if spec.num_rows is None:
            raise ValueError(f"table {spec.name!r}: a FixedShard holds a fixed table")
        every = torch.arange(spec.num_rows, dtype=torch.int64)
        self.owned = every[shard_of(every, num_shards) == shard]  # [n_k] increasing
        n = int(self.owned.numel())
        self.local = torch.full((spec.num_rows,), -1, dtype=torch.int32)  # id -> local row
        self.local[self.owned] = torch.arange(n, dtype=torch.int32)
        self.spec = spec
        # At least one row (a table needs one); a spare row is never addressed.
        self.table = LocalTable(replace(spec, num_rows=max(n, 1)), initialise=False)
        self.table.row_table_ids = self.owned
        for start in range(0, n, _INIT_CHUNK):
            ids = self.owned[start : start + _INIT_CHUNK]
            self.table.weights[start : start + ids.numel()] = spec.initial_rows(ids)
        if part is not None and part.ids.numel() > 0:
            rows = self._rows(part.ids)
            self.table.weights[rows] = part.weights.to(self.table.weights.dtype)
            self.table.state[rows] = part.state
            self.table.clocks[rows] = part.clocks

    @property
    def lock(self) -> threading.Lock:
        return self.table.lock

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Local rows ``[N]`` of the table's ``ids`` ``[N]`` (all routed here)."""
        return self.local[ids].to(torch.int64)

    def stats(self) -> dict[str, int | float]:
        return self.table.stats()

    def pull(self, ids: torch.Tensor, clocks: torch.Tensor | None, bound: int | None) -> PullResult:
        return self.table.pull(self._rows(ids), clocks, bound)

    def push(
        self,
        ids: torch.Tensor,
        grads: torch.Tensor,
        *,
        checked: bool = False,
        counted: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        self.table.push(self._rows(ids), grads, checked=checked, counted=counted)

    def write(
        self, ids: torch.Tensor, rows: torch.Tensor, state: torch.Tensor, clocks: torch.Tensor
    ) -> None:
        self.table.write(self._rows(ids), rows, state, clocks)

    def read_clocks(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.read_clocks(self._rows(ids))

    def read_state(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.read_state(self._rows(ids))

    def parts(self, max_rows: int = 1 << 20) -> Iterator[TablePart]:
        """This shard's rows as checkpoint parts, with the table's ids."""
        n = int(self.owned.numel())
        for p in self.table.parts(max_rows):
            keep = p.ids < n  # not the spare row of an empty shard
            if not bool(keep.all()):
                p = p.select(keep)
            if p.ids.numel() == 0 and n > 0:
                continue
            yield TablePart(
                ids=self.owned[p.ids], weights=p.weights, state=p.state, clocks=p.clocks
            )
