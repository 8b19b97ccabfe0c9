"""One collection API for sparse features, with three placements chosen per table.

``EmbeddingCollection(tables, store=..., group=...)`` splits its tables by
``TableConfig.placement``:

* ``"local"``  -> :class:`embedding.local_tables.LocalTables`: all local tables fused
  into one flat weight per (dim, optimizer), one gather+pool per batch, backward fused
  with the optimizer; replicated when data parallel.
* ``"hybrid"`` -> :class:`embedding.hybrid.HybridTables`: rows in a ``ps`` store (a
  ``cache.CachedStore`` is just another store); pulled by unique id, gradients pushed.
* ``"sharded"`` -> ``embedding.sharded.ShardedTables``: tables owned by ranks, ids and
  pooled rows travel by alltoallv.

``forward(kjt)`` returns ``{feature: [B, D]}`` (``[B, T, D]`` for ``pooling="none"``)
in the order of ``kjt.keys``. Row updates happen inside ``backward()``; there is no
embedding optimizer step and no embedding ``nn.Parameter``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import nn

from comm import LocalGroup, ProcessGroup
from embedding.checkpoint_io import write_from_rank0
from embedding.config import TableConfig
from embedding.hybrid import HybridTables
from embedding.jagged import KeyedJaggedIds
from embedding.local_tables import LocalTables
from ps import InProcessStore, Store, TableSpec
from ps.checkpoint import TablePart


class EmbeddingCollection(nn.Module):
    """Embeddings for the sparse features of a :class:`KeyedJaggedIds` batch.

    * ``store``: where hybrid tables live (default: a fresh :class:`ps.InProcessStore`).
      The collection creates the tables the store lacks; one it already holds is
      reused when its spec is identical (so several modules can share one store) and
      rejected otherwise, naming both shapes. On a shared store (below) rank 0
      creates them while the other ranks wait, so workers never race to create one
      table (a collective: every rank builds the collection).
    * ``group``: the data-parallel group (default :class:`comm.LocalGroup`). Local
      tables and hybrid tables in a replicated store are replicated per rank and
      every rank applies the average of all ranks' row gradients; sharded tables are
      split over the group's ranks.
    * ``store_is_shared``: whether ``store`` is one copy shared by all ranks (MPI
      servers, Redis): then each rank pushes its own gradients divided by
      ``group.size`` and nothing is gathered. None (default) detects it: an
      ``InProcessStore`` (also behind a cache) is per-rank, any other store shared.

    Training (``module.train()`` and grad enabled) updates rows during
    ``backward()``; under ``torch.no_grad()`` or ``.eval()`` forward only reads.
    """

    def __init__(
        self,
        tables: Sequence[TableConfig],
        *,
        store: Store | None = None,
        group: ProcessGroup | None = None,
        store_is_shared: bool | None = None,
    ) -> None:
        super().__init__()
        tables = list(tables)
        if not tables:
            raise ValueError("EmbeddingCollection: needs at least one TableConfig")
        self._configs: dict[str, TableConfig] = {}
        self._table_of: dict[str, str] = {}  # feature -> table
        for cfg in tables:
            if not isinstance(cfg, TableConfig):
                raise TypeError(
                    f"EmbeddingCollection: tables must be TableConfig, got {type(cfg).__name__}"
                )
            if cfg.name in self._configs:
                raise ValueError(f"EmbeddingCollection: table name {cfg.name!r} appears twice")
            for feat in cfg.feature_names:
                if feat in self._table_of:
                    raise ValueError(
                        f"EmbeddingCollection: feature {feat!r} is mapped to two tables, "
                        f"{self._table_of[feat]!r} and {cfg.name!r}"
                    )
                self._table_of[feat] = cfg.name
            self._configs[cfg.name] = cfg
        self.group: ProcessGroup = LocalGroup() if group is None else group
        self.store: Store = InProcessStore() if store is None else store
        by_placement: dict[str, list[TableConfig]] = {"local": [], "hybrid": [], "sharded": []}
        for cfg in tables:
            by_placement[cfg.placement].append(cfg)
        self.local: LocalTables | None = None
        self.hybrid: HybridTables | None = None
        self.sharded: nn.Module | None = None
        if by_placement["local"]:
            self.local = LocalTables(by_placement["local"], self.group)
        if by_placement["hybrid"]:
            self.hybrid = HybridTables(
                by_placement["hybrid"], self.store, self.group, store_is_shared
            )
        if by_placement["sharded"]:
            self.sharded = _make_sharded(by_placement["sharded"], self.group)

    # ------------------------------------------------------------ accessors

    @property
    def tables(self) -> list[TableConfig]:
        return list(self._configs.values())

    @property
    def feature_names(self) -> list[str]:
        return list(self._table_of)

    def table_of(self, feature: str) -> TableConfig:
        return self._configs[self._table_of[feature]]

    def extra_repr(self) -> str:
        parts = [
            f"{c.name}: {c.num_rows}x{c.dim} {c.pooling} {c.placement} {c.feature_names}"
            for c in self._configs.values()
        ]
        return f"tables=[{'; '.join(parts)}], group={self.group!r}"

    def rows(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """Current rows ``ids`` ``[N]`` of a local or hybrid ``table``: ``[N, D]`` (a copy)."""
        cfg = self._config(table)
        if cfg.placement == "local":
            assert self.local is not None
            return self.local.rows(table, ids)
        if cfg.placement == "hybrid":
            return self.store.pull(table, ids).rows
        raise ValueError(f"rows: table {table!r} is sharded; read it from its owner ranks")

    def state(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """Optimizer state of rows ``ids`` of a local or hybrid ``table``: ``[N, S]``."""
        cfg = self._config(table)
        if cfg.placement == "local":
            assert self.local is not None
            return self.local.state(table, ids)
        if cfg.placement == "hybrid":
            return self.store.state(table, ids)
        raise ValueError(f"state: table {table!r} is sharded; read it from its owner ranks")

    def clocks(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """Update counts of rows ``ids`` of a local or hybrid ``table``: int64 ``[N]``."""
        cfg = self._config(table)
        if cfg.placement == "local":
            assert self.local is not None
            return self.local.clocks(table, ids)
        if cfg.placement == "hybrid":
            return self.store.clocks(table, ids)
        raise ValueError(f"clocks: table {table!r} is sharded; read it from its owner ranks")

    def _config(self, table: str) -> TableConfig:
        cfg = self._configs.get(table)
        if cfg is None:
            raise KeyError(f"no table {table!r}; tables: {list(self._configs)}")
        return cfg

    # ------------------------------------------------------------ forward

    def forward(self, kjt: KeyedJaggedIds) -> dict[str, torch.Tensor]:
        if not isinstance(kjt, KeyedJaggedIds):
            raise TypeError(
                f"EmbeddingCollection: expected a KeyedJaggedIds, got {type(kjt).__name__}"
            )
        plan = self._group_keys(kjt)
        out: dict[str, torch.Tensor] = {}
        local = [(c, f) for c, f in plan if c.placement == "local"]
        hybrid = [(c, f) for c, f in plan if c.placement == "hybrid"]
        sharded = [f for c, fs in plan if c.placement == "sharded" for f in fs]
        # In data parallel, a module whose backward exchanges data (local, hybrid over a
        # replicated store, sharded) runs even without features in this batch, and its
        # autograd node is tied to an output (a zero added to the first one), so every
        # rank enters the same collectives in backward.
        dp = self.group.size > 1
        ran: list[nn.Module] = []
        if self.local is not None and (local or dp):
            out.update(self.local(kjt, local))
            ran.append(self.local)
        if self.hybrid is not None and (hybrid or (dp and not self.hybrid.store_is_shared)):
            out.update(self.hybrid(kjt, hybrid))
            ran.append(self.hybrid)
        if self.sharded is not None and (sharded or dp):
            out.update(self.sharded(kjt.select(sharded)))
            ran.append(self.sharded)
        result = {k: out[k] for k in kjt.keys}
        ties = [t for m in ran if (t := getattr(m, "tie", None)) is not None]
        if ties and dp:
            if not result:
                raise ValueError(
                    f"EmbeddingCollection: rank {self.group.rank}'s batch has no feature, "
                    "but in data parallel every rank must run backward through the "
                    "collection; pass every feature (empty bags are fine)"
                )
            first = kjt.keys[0]
            result[first] = result[first] + sum(ties)
        return result

    def prefetch(self, kjt: KeyedJaggedIds) -> None:
        """Announce a coming batch: each hybrid table's unique ids go to
        ``store.prefetch(table, ids)`` when the store has one (a cache); else nothing."""
        if not isinstance(kjt, KeyedJaggedIds):
            raise TypeError(
                f"EmbeddingCollection.prefetch: expected a KeyedJaggedIds, got {type(kjt).__name__}"
            )
        if self.hybrid is None:
            return
        plan = [(c, f) for c, f in self._group_keys(kjt) if c.placement == "hybrid"]
        self.hybrid.prefetch(kjt, plan)

    def _group_keys(self, kjt: KeyedJaggedIds) -> list[tuple[TableConfig, list[str]]]:
        """Tables touched by the batch (in table order) with their features (in key order)."""
        per_table: dict[str, list[str]] = {}
        for key in kjt.keys:
            table = self._table_of.get(key)
            if table is None:
                raise ValueError(
                    f"EmbeddingCollection: feature {key!r} is not in any table; known "
                    f"features: {self.feature_names}"
                )
            per_table.setdefault(table, []).append(key)
        return [(cfg, per_table[name]) for name, cfg in self._configs.items() if name in per_table]

    # ------------------------------------------------------------ checkpoints

    def save(self, path: str | os.PathLike[str]) -> None:
        """Save the local and sharded tables whole in one ps checkpoint (JSON manifest +
        ``.npy``, no pickle), loadable by any collection with those tables (any number of
        ranks, any placement) or by a store.

        Collective in data parallel: sharded tables are gathered, rank 0 writes, and
        every rank returns once the checkpoint is complete. Hybrid tables live in the
        store: save them with ``store.save``.
        """
        if self.local is None and self.sharded is None:
            raise ValueError(
                "save: this collection has no local or sharded tables (hybrid: store.save)"
            )
        write_from_rank0(self.group, path, self.checkpoint_parts(), "embedding.EmbeddingCollection")

    def checkpoint_parts(self) -> list[tuple[TableSpec, TablePart]]:
        """Every local and sharded table whole (rows, optimizer state, clocks) as ``(spec,
        part)`` for :func:`ps.checkpoint.write_checkpoint`; empty without such tables.
        Collective in data parallel when there are sharded tables (they are gathered)."""
        parts = [] if self.local is None else self.local.checkpoint_parts()
        if self.sharded is not None:
            parts += self.sharded.checkpoint_parts()  # type: ignore[operator]
        return parts

    def load(self, path: str | os.PathLike[str]) -> None:
        """Load the local and sharded tables from a ps checkpoint (from :meth:`save`, or
        a store's ``save``); each rank copies the rows it holds."""
        if self.local is None and self.sharded is None:
            raise ValueError(
                "load: this collection has no local or sharded tables (hybrid: store.load)"
            )
        if self.local is not None:
            self.local.load(path)
        if self.sharded is not None:
            self.sharded.load(path)  # type: ignore[operator]


def _make_sharded(configs: list[TableConfig], group: ProcessGroup) -> nn.Module:
    try:
        from embedding.sharded import ShardedTables
    except ModuleNotFoundError as err:
        if err.name != "embedding.sharded":
            raise
        names = [c.name for c in configs]
        raise NotImplementedError(
            f"EmbeddingCollection: tables {names} have placement='sharded', but "
            "embedding.sharded is not available yet; use placement='local' or 'hybrid'"
        ) from None
    module: nn.Module = ShardedTables(configs, group)
    return module
