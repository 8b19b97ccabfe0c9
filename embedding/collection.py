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

Device: the collection works on one device (``device=``, default
:func:`comm.default_device` of the group); a batch on another device is moved
once at :meth:`forward` and the outputs are on the collection's device. Local and
sharded tables live there; hybrid tables stay in their (host) store, and their
pulled rows are copied to the device once per step.

Module state: the tables are in ``state_dict()`` (keys below), ``.to(device)``
moves them, ``load_state_dict()`` restores them::

    local.<table>.weight  [n, D]   local.<table>.state  [n, S]   local.<table>.clocks [n]
    sharded.<table>.ids   [n]      global row ids of this rank's shard, then its
    sharded.<table>.weight / .state / .clocks
    hybrid.<table>.ids    [n]      the rows the store holds (read through it), then
    hybrid.<table>.weight / .state / .clocks

Keys are per table, so a dict loads into a collection that fuses its tables
differently; sharded rows carry their global ids, so a dict loads at any sharding
(each rank copies the rows it owns). Loading hybrid entries replaces the table in
the store. ``save``/``load`` write and read every placement in one ps checkpoint.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from comm import LocalGroup, ProcessGroup, boundary
from comm.agreement import agree, run_on_rank0
from comm.device import module_device
from embedding.checks import features_by_table, table_of_features
from embedding.config import TableConfig
from embedding.hybrid import HybridTables, backing_store
from embedding.jagged import KeyedJaggedIds
from embedding.local_tables import LocalTables
from embedding.table_state import target_device
from ps import InProcessStore, Store, TableSpec
from ps.checkpoint import Checkpoint, TablePart, read_checkpoint, write_checkpoint

_WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


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
    * ``device``: where the worker computes (local and sharded tables, pooling,
      outputs); None (default) is :func:`comm.default_device` of ``group``. Stores
      and caches stay on the host.

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
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        tables = list(tables)
        if not tables:
            raise ValueError("EmbeddingCollection: needs at least one TableConfig")
        self._configs: dict[str, TableConfig] = {}
        for cfg in tables:
            if not isinstance(cfg, TableConfig):
                raise TypeError(
                    f"EmbeddingCollection: tables must be TableConfig, got {type(cfg).__name__}"
                )
            if cfg.name in self._configs:
                raise ValueError(f"EmbeddingCollection: table name {cfg.name!r} appears twice")
            self._configs[cfg.name] = cfg
        self._table_of: dict[str, str] = {  # feature -> table
            feat: tables[i].name
            for feat, i in table_of_features(tables, "EmbeddingCollection").items()
        }
        self.group: ProcessGroup = LocalGroup() if group is None else group
        self.store: Store = InProcessStore() if store is None else store
        try:
            dev = module_device(self.group, device)
        except (RuntimeError, TypeError, ValueError) as e:
            raise ValueError(f"EmbeddingCollection: {e}") from None
        self._device = dev
        by_placement: dict[str, list[TableConfig]] = {"local": [], "hybrid": [], "sharded": []}
        for cfg in tables:
            by_placement[cfg.placement].append(cfg)
        self.local: LocalTables | None = None
        self.hybrid: HybridTables | None = None
        self.sharded: nn.Module | None = None
        if by_placement["local"]:
            self.local = LocalTables(by_placement["local"], self.group, dev)
        if by_placement["hybrid"]:
            self.hybrid = HybridTables(
                by_placement["hybrid"], self.store, self.group, store_is_shared, dev
            )
        if by_placement["sharded"]:
            self.sharded = _make_sharded(by_placement["sharded"], self.group, dev)

    @property
    def device(self) -> torch.device:
        """Where this collection computes and returns its outputs (follows ``.to()``)."""
        return self._device

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        """``.to(device)`` / ``.cuda()`` / ``.cpu()`` move every placement's tables (the
        hybrid rows stay in their store); a dtype cast leaves the tables float32."""
        super()._apply(fn, recurse)
        self._device = target_device(fn, torch.empty(0, device=self._device))
        return self

    @contextmanager
    def tables_left_out(self) -> Iterator[None]:
        """Within it, ``state_dict()`` and ``load_state_dict()`` skip the tables (for a
        model checkpoint that saves the collection with :meth:`save` instead; reading
        hybrid tables through their store for a state dict would be wasted)."""
        parts = [p for p in (self.local, self.hybrid, self.sharded) if p is not None]
        for p in parts:
            setattr(p, "state_dict_tables", False)  # noqa: B010 - nn.Module's typing
        try:
            yield
        finally:
            for p in parts:
                setattr(p, "state_dict_tables", True)  # noqa: B010

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
        return f"tables=[{'; '.join(parts)}], group={self.group!r}, device={self._device}"

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
        if self._device.type == "cuda":
            # Triton launches on the current device's stream whatever its tensors' device:
            # a collection on cuda:1 in a process whose current device is 0 must switch.
            with torch.cuda.device(self._device):
                return self._forward(kjt)
        return self._forward(kjt)

    def _forward(self, kjt: KeyedJaggedIds) -> dict[str, torch.Tensor]:
        kjt = self._on_device(kjt, "EmbeddingCollection")
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

    def set_sparse_pipeline(self, on: bool) -> None:
        """Pipeline the hybrid tables' sparse step (:meth:`HybridTables.set_pipelined`):
        the batch announced by :meth:`prefetch` is pulled on a background thread while
        this batch's dense step runs, and each push runs there too. Nothing without
        hybrid tables (local and sharded tables have no store to wait for)."""
        if self.hybrid is not None:
            self.hybrid.set_pipelined(on)

    def drain(self) -> None:
        """Wait until the sparse pipeline's store calls are done (raising a failed
        push's error); nothing without it. Before reading a store's counters."""
        if self.hybrid is not None:
            self.hybrid.drain()

    @property
    def sparse_pipelined(self) -> bool:
        return self.hybrid is not None and self.hybrid.pipeline is not None

    def prefetch(self, kjt: KeyedJaggedIds) -> None:
        """Announce a coming batch: each hybrid table's unique ids go to
        ``store.prefetch(table, ids)`` when the store has one and fetches ahead (a cache
        whose ``prefetching`` is on); else nothing.
        With the sparse pipeline on, the batch is pulled on the pipeline's thread once
        this step's rows are taken (:meth:`set_sparse_pipeline`)."""
        if not isinstance(kjt, KeyedJaggedIds):
            raise TypeError(
                f"EmbeddingCollection.prefetch: expected a KeyedJaggedIds, got {type(kjt).__name__}"
            )
        if self.hybrid is None:
            return
        # The store takes host ids: HybridTables.prefetch brings a device batch to the
        # host once (a host batch stays there: nothing goes to the device for this).
        plan = [(c, f) for c, f in self._group_keys(kjt) if c.placement == "hybrid"]
        self.hybrid.prefetch(kjt, plan)

    def _on_device(self, kjt: object, who: str) -> KeyedJaggedIds:
        """The batch on this collection's device, moved once (``non_blocking``: from pinned
        memory the copy overlaps). Its key boundaries are measured first where it is (on
        the host: no device read later). Dtypes and shapes were checked when the batch
        was built (``KeyedJaggedIds`` refuses others); what is left to check here are
        the devices of its three tensors, which may differ from each other."""
        if not isinstance(kjt, KeyedJaggedIds):
            raise TypeError(f"{who}: expected a KeyedJaggedIds, got {type(kjt).__name__}")
        dev = self._device
        w = kjt.weights
        if w is not None and w.dtype not in _WEIGHT_DTYPES:
            raise TypeError(
                f"{who}: per-id weights of features {kjt.keys} are {w.dtype}, expected one of "
                f"{[str(d) for d in _WEIGHT_DTYPES]}"
            )
        if kjt.lengths.device.type == "cpu":
            kjt.key_starts()  # host ints from host lengths (ids may be on the device already)
        # Through the boundary even when the batch is here (returned as it is): a host
        # batch crosses here on a GPU worker, so a CPU run makes the same calls.
        return boundary.move(kjt, dev)

    def _group_keys(self, kjt: KeyedJaggedIds) -> list[tuple[TableConfig, list[str]]]:
        """Tables touched by the batch (in table order) with their features (in key order)."""
        per_table = features_by_table(kjt.keys, self._table_of, "EmbeddingCollection")
        return [(cfg, per_table[name]) for name, cfg in self._configs.items() if name in per_table]

    # ------------------------------------------------------------ checkpoints

    def save(self, path: str | os.PathLike[str]) -> None:
        """Save every table whole (local, sharded and hybrid: rows, optimizer state,
        clocks) in one ps checkpoint (JSON manifest + ``.npy``, no pickle) at ``path``,
        loadable by any collection with those tables (any number of ranks, any
        placement) or by a store.

        Collective in data parallel: sharded tables are gathered; every rank pushes its
        pending cache updates to the store; rank 0 reads the hybrid tables through the
        store and writes; every rank returns once the checkpoint is complete.
        """
        parts = self.checkpoint_parts()  # collective when there are sharded tables
        if self.hybrid is not None:
            error: Exception | None = None
            try:
                self.hybrid.flush()  # this rank's pending updates reach the store
            except Exception as e:  # every rank must learn it
                error = e
            agree(self.group, error, f"flushing the caches before saving {str(path)!r}")

        def write() -> None:
            every = parts + ([] if self.hybrid is None else self.hybrid.table_parts())
            order = {name: i for i, name in enumerate(self._configs)}
            every.sort(key=lambda sp: order[sp[0].name])
            write_checkpoint(
                path, [(spec, [part]) for spec, part in every],
                writer="embedding.EmbeddingCollection",
            )  # fmt: skip

        run_on_rank0(self.group, write, f"saving {str(path)!r}")

    def checkpoint_parts(self) -> list[tuple[TableSpec, TablePart]]:
        """Every local and sharded table whole (rows, optimizer state, clocks) as ``(spec,
        part)`` for :func:`ps.checkpoint.write_checkpoint`; empty without such tables.
        Collective in data parallel when there are sharded tables (they are gathered).
        Hybrid tables are in their store (:meth:`save` reads them through it)."""
        parts = [] if self.local is None else self.local.checkpoint_parts()
        if self.sharded is not None:
            parts += self.sharded.checkpoint_parts()  # type: ignore[operator]
        return parts

    def load(self, path: str | os.PathLike[str], *, hybrid: bool = True) -> None:
        """Load every table from a ps checkpoint (from :meth:`save`, or a store's
        ``save``; a table saved under any placement loads into any placement). Every
        table must be in it with the same rows, dim and optimizer (checked before
        anything changes). Local and sharded tables: each rank copies the rows it holds.
        Hybrid tables (collective): the tables are replaced in the store, by every rank
        for a per-rank store, by rank 0 for a shared one, after every rank flushed its
        cache; every cache then starts empty. ``hybrid=False`` leaves the hybrid tables
        as they are (a model checkpoint loads their store on its own)."""
        error: Exception | None = None
        ckpt = None
        try:
            ckpt = read_checkpoint(path)
            for cfg in self._configs.values():
                if hybrid or cfg.placement != "hybrid":
                    ckpt.expect(cfg.to_spec())
        except Exception as e:  # every rank must learn it before any collective
            error = e
        if self.hybrid is not None and hybrid:
            agree(self.group, error, f"checking {str(path)!r}")
        elif error is not None:
            raise error
        if self.local is not None:
            self.local.load(path)
        if self.sharded is not None:
            self.sharded.load(path)  # type: ignore[operator]
        if self.hybrid is not None and hybrid:
            assert ckpt is not None
            self._load_hybrid(Path(path), ckpt)

    def _load_hybrid(self, path: Path, ckpt: Checkpoint) -> None:
        """Collective: the hybrid tables of the checkpoint ``ckpt`` (read from ``path``)
        into the store; see :meth:`load`."""
        assert self.hybrid is not None
        hybrid = self.hybrid
        error: Exception | None = None
        try:
            hybrid.flush()  # nothing of the old rows may reach the store after the load
        except Exception as e:
            error = e
        agree(self.group, error, f"flushing the caches before loading {str(path)!r}")
        names = list(hybrid.configs)
        store = backing_store(self.store)

        def load_store() -> None:
            if sorted(ckpt.tables()) == sorted(names):
                store.load(path)  # the checkpoint holds exactly these tables
                return
            # Only the hybrid tables go into the store: a filtered copy of the checkpoint.
            parts = [(hybrid.configs[n].to_spec(), ckpt.read_table(n)) for n in names]
            with tempfile.TemporaryDirectory(prefix=".hybrid-", dir=_temp_parent(path)) as tmp:
                where = Path(tmp) / "tables"
                write_checkpoint(
                    where, [(s, [p]) for s, p in parts], writer="embedding.EmbeddingCollection"
                )
                store.load(where)

        what = f"loading the hybrid tables {names} from {str(path)!r}"
        if hybrid.store_is_shared:
            run_on_rank0(self.group, load_store, what)
        else:
            try:
                load_store()
            except Exception as e:
                error = e
            agree(self.group, error, what)
        forget = getattr(self.store, "load_cache_state", None)
        if forget is not None:
            forget({})  # the cached copies are void: every cache starts empty


def _temp_parent(path: Path) -> str | None:
    """Where a temporary checkpoint for the store goes: beside ``path`` (the store's
    servers see that file system, as they see ``path``), else the system's temp."""
    parent = path.resolve().parent
    return str(parent) if os.access(parent, os.W_OK) else None


def _make_sharded(
    configs: list[TableConfig], group: ProcessGroup, device: torch.device
) -> nn.Module:
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
    module: nn.Module = ShardedTables(configs, group, device=device)
    return module
