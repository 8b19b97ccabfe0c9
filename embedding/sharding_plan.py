"""Which rank owns which rows of each sharded table.

Every table is cut into ``world_size`` contiguous row ranges, one per rank in
rank order; range ``r`` is ``[bounds[r], bounds[r + 1])``. A **table-wise**
table has one non-empty range (the whole table on one rank), a **row-wise**
table is split across all ranks::

    world_size = 3
    table "users" (10 rows, table-wise on rank 1):  bounds = [0, 0, 10, 10]
        rank 0: []   rank 1: rows 0..9   rank 2: []
    table "items" (8 rows, row-wise):               bounds = [0, 3, 6, 8]
        rank 0: rows 0..2   rank 1: rows 3..5   rank 2: rows 6..7

One representation for both kinds keeps the routing a single ``searchsorted``:
the owner of id ``i`` is the rank ``r`` with ``bounds[r] <= i < bounds[r + 1]``,
and its row on that rank is ``i - bounds[r]``. Because the ranges run in rank
order, concatenating every rank's shard in rank order gives the whole table.

:meth:`ShardingPlan.build` is a pure function of the configs and the world size,
so every rank computes the same plan without talking to anyone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from comm import boundary
from embedding.config import TableConfig
from ps.table import TORCH_ROW_DTYPES

#: Tables with more rows than this are split row-wise by default.
DEFAULT_ROW_WISE_THRESHOLD_ROWS = 1 << 20


@dataclass(slots=True, frozen=True)
class TableShards:
    """One table's row ranges: rank ``r`` owns rows ``[bounds[r], bounds[r + 1])``."""

    name: str
    num_rows: int
    dim: int
    bounds: tuple[int, ...]  # [world_size + 1], non-decreasing, 0 .. num_rows

    def __post_init__(self) -> None:
        b = self.bounds
        if len(b) < 2 or b[0] != 0 or b[-1] != self.num_rows:
            raise ValueError(
                f"table {self.name!r}: row bounds {list(b)} must start at 0 and end at "
                f"num_rows={self.num_rows} (one range per rank)"
            )
        if any(not isinstance(x, int) or isinstance(x, bool) for x in b):
            raise TypeError(f"table {self.name!r}: row bounds must be ints, got {list(b)}")
        if any(b[i] > b[i + 1] for i in range(len(b) - 1)):
            raise ValueError(f"table {self.name!r}: row bounds {list(b)} must not decrease")

    @property
    def world_size(self) -> int:
        return len(self.bounds) - 1

    @property
    def owners(self) -> list[int]:
        """Ranks holding at least one row, in rank order."""
        return [r for r in range(self.world_size) if self.bounds[r + 1] > self.bounds[r]]

    @property
    def row_wise(self) -> bool:
        return len(self.owners) > 1

    def rows_on(self, rank: int) -> tuple[int, int]:
        """``(start, stop)``: the global rows ``rank`` owns (``start == stop``: none)."""
        return self.bounds[rank], self.bounds[rank + 1]


def _rows_dim(cfg: TableConfig) -> tuple[int, int]:
    if cfg.num_rows is None:
        raise ValueError(
            f"table {cfg.name!r}: a sharded table needs a fixed num_rows, got None "
            "(dynamic tables live on the parameter server: placement='hybrid')"
        )
    return cfg.num_rows, cfg.dim


def _row_bytes(cfg: TableConfig) -> int:
    """Bytes one row costs its owner: weights in the table's row type (4 bytes per
    element, 2 for fp16 and bf16) plus float32 optimizer state."""
    weight_bytes = TORCH_ROW_DTYPES[cfg.dtype].itemsize
    return weight_bytes * cfg.dim + 4 * cfg.optimizer.state_dim(cfg.dim)


@dataclass(slots=True, frozen=True)
class ShardingPlan:
    """Row ranges of every sharded table over ``world_size`` ranks (see the module doc)."""

    world_size: int
    tables: tuple[TableShards, ...]

    def __post_init__(self) -> None:
        w = self.world_size
        if not isinstance(w, int) or isinstance(w, bool) or w < 1:
            raise ValueError(f"ShardingPlan: world_size must be an int >= 1, got {w!r}")
        names = [t.name for t in self.tables]
        if len(set(names)) != len(names):
            dups = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"ShardingPlan: tables {dups} appear more than once")
        for t in self.tables:
            if t.world_size != w:
                raise ValueError(
                    f"ShardingPlan: table {t.name!r} has {t.world_size} row ranges "
                    f"(bounds {list(t.bounds)}), expected one per rank: {w}"
                )

    # ------------------------------------------------------------ construction

    @classmethod
    def build(
        cls,
        configs: Sequence[TableConfig],
        world_size: int,
        *,
        row_wise_threshold_rows: int | None = DEFAULT_ROW_WISE_THRESHOLD_ROWS,
    ) -> ShardingPlan:
        """Place ``configs`` on ``world_size`` ranks.

        Tables with more than ``row_wise_threshold_rows`` rows (None: never) are
        split row-wise over all ranks, as evenly as possible (the first
        ``num_rows % world_size`` ranks get one row more). The other tables go
        whole to one rank each, greedily: largest first (bytes of weights plus
        optimizer state; ties by name), each to the rank with the fewest bytes so
        far (ties: the lowest rank). Deterministic: the same on every rank.
        """
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(
                f"ShardingPlan.build: world_size must be an int >= 1, got {world_size!r}"
            )
        thr = row_wise_threshold_rows
        if thr is not None and (not isinstance(thr, int) or isinstance(thr, bool) or thr < 1):
            raise ValueError(
                f"ShardingPlan.build: row_wise_threshold_rows must be None or an int >= 1, "
                f"got {thr!r}"
            )
        configs = list(configs)
        for cfg in configs:
            if not isinstance(cfg, TableConfig):
                raise TypeError(
                    f"ShardingPlan.build: expected TableConfig, got {type(cfg).__name__}"
                )
        names = [c.name for c in configs]
        if len(set(names)) != len(names):
            dups = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"ShardingPlan.build: table names {dups} appear more than once")
        load = [0] * world_size  # bytes per rank
        bounds: dict[str, tuple[int, ...]] = {}
        whole: list[TableConfig] = []
        for cfg in configs:
            rows, _ = _rows_dim(cfg)
            if thr is not None and rows > thr and world_size > 1:
                base, extra = divmod(rows, world_size)
                sizes = [base + (1 if r < extra else 0) for r in range(world_size)]
                b = [0]
                for r, s in enumerate(sizes):
                    b.append(b[-1] + s)
                    load[r] += s * _row_bytes(cfg)
                bounds[cfg.name] = tuple(b)
            else:
                whole.append(cfg)
        whole.sort(key=lambda c: (-(_rows_dim(c)[0] * _row_bytes(c)), c.name))
        for cfg in whole:
            rows, _ = _rows_dim(cfg)
            owner = min(range(world_size), key=lambda r: (load[r], r))
            load[owner] += rows * _row_bytes(cfg)
            bounds[cfg.name] = tuple([0] * (owner + 1) + [rows] * (world_size - owner))
        tables = tuple(
            TableShards(name=c.name, num_rows=c.num_rows or 0, dim=c.dim, bounds=bounds[c.name])
            for c in configs
        )
        return cls(world_size=world_size, tables=tables)

    @classmethod
    def from_bounds(
        cls, configs: Sequence[TableConfig], bounds: Mapping[str, Sequence[int]]
    ) -> ShardingPlan:
        """A hand-made plan: ``bounds[table]`` lists ``world_size + 1`` row boundaries."""
        configs = list(configs)
        missing = sorted({c.name for c in configs} - set(bounds))
        unknown = sorted(set(bounds) - {c.name for c in configs})
        if missing or unknown:
            raise ValueError(
                f"ShardingPlan.from_bounds: no bounds for tables {missing}, bounds for unknown "
                f"tables {unknown}"
            )
        sizes = {len(bounds[c.name]) - 1 for c in configs}
        if len(sizes) != 1:
            raise ValueError(
                "ShardingPlan.from_bounds: every table needs the same number of ranges, got "
                f"{ {c.name: len(bounds[c.name]) - 1 for c in configs} }"
            )
        tables = tuple(
            TableShards(
                name=c.name,
                num_rows=_rows_dim(c)[0],
                dim=c.dim,
                bounds=tuple(bounds[c.name]),
            )
            for c in configs
        )
        return cls(world_size=sizes.pop(), tables=tables)

    # ------------------------------------------------------------ queries

    @property
    def table_names(self) -> list[str]:
        return [t.name for t in self.tables]

    def table(self, name: str) -> TableShards:
        for t in self.tables:
            if t.name == name:
                return t
        raise KeyError(f"ShardingPlan: no table {name!r}; tables: {self.table_names}")

    def bounds_tensor(self, name: str) -> torch.Tensor:
        """int64 ``[world_size + 1]`` row bounds of ``name``."""
        return torch.tensor(self.table(name).bounds, dtype=torch.int64)

    def owner_of(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """int64 ``[N]``: the rank owning each id of ``ids`` (int64 ``[N]``, in range)."""
        b = boundary.constant(tuple(self.table(name).bounds), ids.device)  # [W + 1], kept there
        # Number of upper bounds <= id; empty ranges (equal bounds) are skipped over.
        return torch.searchsorted(b[1:], ids, right=True)

    def local_rows(self, name: str, ids: torch.Tensor, owners: torch.Tensor) -> torch.Tensor:
        """int64 ``[N]``: each id's row within its owner's shard (``ids - start``)."""
        b = boundary.constant(tuple(self.table(name).bounds), ids.device)  # [W + 1]
        return ids - b[owners]

    def bytes_per_rank(self, configs: Sequence[TableConfig]) -> list[int]:
        """Weights plus optimizer state each rank holds under this plan."""
        by_name = {c.name: c for c in configs}
        load = [0] * self.world_size
        for t in self.tables:
            rb = _row_bytes(by_name[t.name])
            for r in range(self.world_size):
                lo, hi = t.rows_on(r)
                load[r] += (hi - lo) * rb
        return load

    def fingerprint(self) -> list[int]:
        """Small ints identifying the plan (ranks compare them to agree on one plan)."""
        import zlib

        text = ";".join(f"{t.name}:{t.dim}:{','.join(map(str, t.bounds))}" for t in self.tables)
        return [self.world_size, len(self.tables), zlib.crc32(text.encode("utf-8"))]

    def describe(self) -> str:
        """One line per table, for logs."""
        lines = [f"ShardingPlan over {self.world_size} ranks:"]
        for t in self.tables:
            if t.row_wise:
                ranges = ", ".join(
                    f"r{r}:[{t.bounds[r]},{t.bounds[r + 1]})" for r in range(self.world_size)
                )
                lines.append(f"  {t.name} {t.num_rows}x{t.dim} row-wise {ranges}")
            else:
                owner = t.owners[0] if t.owners else 0
                lines.append(f"  {t.name} {t.num_rows}x{t.dim} table-wise on rank {owner}")
        return "\n".join(lines)
