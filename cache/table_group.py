"""Tables that share one cache: their ids packed into one id space, table after table.

A step of a DLRM touches 26 tables; a cache per table pays its fixed per-call work
(plans, installs, updates: a few dozen numpy calls each) 26 times per step, which costs
more than the rows themselves at ~1 k ids per table. FBGEMM's table-batched embedding
cache does what this module enables: tables of one width share ONE cache, so a step is
one plan, one install and one update over all their ids, and hot rows of every table
compete for the same slots.

Table ``i`` of a group owns the packed ids ``bases[i] .. bases[i + 1] - 1``: packed id
``bases[i] + id``. The cache (:class:`cache.table_cache.TableCache`) works on packed
ids as if the group were one fixed table (:attr:`TableGroup.spec`); its requests go to
the store as group requests over the same id space (:mod:`ps.group_requests`), which
a store cuts into its tables' requests, or serves whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from cache.kernels.pack_ids import pack_ids
from ps import Store, TableSpec
from ps.group_requests import GroupPull, IdSpace, split_pull
from ps.validate import check_id_tensor, check_ids


@dataclass(frozen=True, slots=True, eq=False)
class TableGroup:
    """Fixed-size tables of one ``dim`` cached together (see the module docstring)."""

    space: IdSpace  # the tables' names and bases, also what the store's group requests use
    spec: TableSpec  # the packed table the cache sees (first member's optimizer)
    members: tuple[TableSpec, ...]  # [k] the tables, in ``names`` order
    at: dict[str, int]  # name -> index in ``names``

    @property
    def names(self) -> tuple[str, ...]:
        return self.space.names

    @property
    def bases(self) -> np.ndarray:
        """int64 ``[k + 1]``: where each table's packed ids start; the last: the total."""
        return self.space.bases

    @classmethod
    def of(cls, specs: list[TableSpec]) -> TableGroup:
        """The group of ``specs`` (fixed tables of one ``dim``), in this order."""
        if len(specs) < 2:
            raise ValueError(f"a table group needs at least 2 tables, got {len(specs)}")
        dims = {s.dim for s in specs}
        if len(dims) != 1 or any(s.num_rows is None for s in specs):
            raise ValueError(
                "a table group holds fixed tables of one dim, got "
                + ", ".join(f"{s.name!r} ({s.num_rows} x {s.dim})" for s in specs)
            )
        rows = [int(s.num_rows or 0) for s in specs]
        bases = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
        names = tuple(s.name for s in specs)
        spec = replace(specs[0], name="+".join(names), num_rows=int(bases[-1]))
        at = {n: i for i, n in enumerate(names)}
        return cls(IdSpace(names, bases), spec, tuple(specs), at)

    def index(self, table: str) -> int:
        return self.at[table]

    def pack(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """Packed ids of ``table``'s ``ids`` (checked ids, int64 ``[N]``)."""
        return ids + int(self.bases[self.index(table)])

    def pack_many(
        self, parts: Sequence[tuple[str, object]], op: str
    ) -> tuple[torch.Tensor, list[int]]:
        """Several member tables' ids checked (as :func:`ps.validate.check_ids` checks
        them, with its words) and packed, one part after the other: ``(packed [N], sizes
        [k])``. One pass for all parts (per-table tensor calls cost more than a step's ~1 k
        ids a table): a C kernel (:mod:`cache.kernels.pack_ids`) checks and moves every id;
        without it numpy checks a segment min and max against each part's table size and
        adds the bases. Only a failed check looks at its part again, to name the id."""
        tables = [self.at[t] for t, _ in parts]
        ids = [
            check_id_tensor(self.members[i], x, op).cpu()
            for i, (_, x) in zip(tables, parts, strict=True)
        ]
        sizes = [int(x.numel()) for x in ids]
        rows = np.diff(self.bases)[tables]  # [k] each part's table size
        packed = pack_ids(ids, self.bases[tables], rows)
        if packed is not None:
            out, first_bad = packed
            if first_bad >= 0:  # raises, naming the id
                check_ids(self.members[tables[first_bad]], ids[first_bad], op)
            return torch.from_numpy(out), sizes
        flat = (ids[0] if len(ids) == 1 else torch.cat(ids)).numpy()  # [N]
        if flat.size == 0:
            return torch.from_numpy(flat.copy()), sizes
        filled = np.flatnonzero(sizes)  # parts with ids (reduceat needs non-empty runs)
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])[filled]
        lo, hi = np.minimum.reduceat(flat, starts), np.maximum.reduceat(flat, starts)
        bad = np.flatnonzero((lo < 0) | (hi >= rows[filled]))
        if bad.size:
            k = int(filled[bad[0]])
            check_ids(self.members[tables[k]], ids[k], op)  # raises, naming the id
        offset = np.repeat(self.bases[tables], sizes)  # [N] each id's table base
        return torch.from_numpy(flat + offset), sizes

    def unpack(self, table: str, packed: torch.Tensor) -> torch.Tensor:
        """``table``'s ids among ``packed`` ids (those outside the table are dropped)."""
        i = self.index(table)
        lo, hi = int(self.bases[i]), int(self.bases[i + 1])
        return packed[(packed >= lo) & (packed < hi)] - lo


class GroupClocks:
    """What a group's cache asks of the store besides requests, for packed ids: PS
    clocks (one store call per member table among the ids) and optimizer state (one
    batched read, :meth:`ps.Store.state_many`)."""

    def __init__(self, group: TableGroup, store: Store) -> None:
        self.group, self.store = group, store

    def clocks(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        def read(parts: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
            return [self.store.clocks(t, i) for t, i in parts]

        return self._per_table(ids, read, torch.empty(0, dtype=torch.int64))

    def state(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        width = self.group.spec.state_dim
        return self._per_table(ids, self.store.state_many, torch.empty(0, width))

    def _per_table(self, ids: torch.Tensor, read: Any, empty: torch.Tensor) -> torch.Tensor:
        """``read([(table, ids), ...])`` of every member's ids among the packed ``ids``
        ``[N]``, in their order: ``[N, ...]``."""
        packed = ids.numpy()
        order = np.argsort(packed, kind="stable")
        sorted_ids = torch.from_numpy(packed[order])
        parts = split_pull(GroupPull(self.group.space, sorted_ids))
        got = read([(r.table, r.ids) for _, r in parts])
        flat = torch.cat(got) if got else empty
        out = torch.empty_like(flat)
        out[torch.from_numpy(order)] = flat
        return out
