"""A collection of PS-backed embedding tables, pooled per feature.

Forward, per table: concatenate the ids of its features in the batch, dedup
them, pull the unique rows from the store, and pool each sample's rows with
``embedding_bag``. Backward is fused with the optimizer (as in TorchRec): the
unique rows are a leaf tensor whose accumulated gradient ``[U, D]`` (already
coalesced per unique id) is pushed to the store by a hook, and the store applies
the table's optimizer. There is no separate optimizer step for embeddings and no
embedding ``nn.Parameter``.

Data parallel (``group.size > 1``): each table is replicated, one copy per rank
(every rank's store starts from the same deterministic rows). The backward hook
gathers every rank's ``(unique ids, row gradients)`` with ``allgatherv``,
divides the gradients by ``group.size`` (the gradient of the global mean loss is
the average of the per-rank gradients of the local mean losses) and pushes the
whole concatenation, so every replica applies the identical update. This needs,
as DDP does, that every rank runs forward on the same tables and then one
backward through every output it used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from comm import LocalGroup, ProcessGroup
from embedding.config import TableConfig
from embedding.jagged import KeyedJaggedIds, offsets_from_lengths
from ps import InProcessStore, Store


@dataclass(slots=True)
class _TableBatch:
    """One table's share of a batch, between dedup and pooling."""

    config: TableConfig
    features: list[str]  # the table's features present in the batch, in batch key order
    inverse: torch.Tensor  # [N] position of each id in ``unique``
    unique: torch.Tensor  # [U] int64 unique ids
    offsets: torch.Tensor  # [F * B + 1] bag offsets into ``inverse``
    weights: torch.Tensor | None  # [N] or None


class EmbeddingCollection(nn.Module):
    """Pooled embeddings for the sparse features of a :class:`KeyedJaggedIds` batch.

    ``forward(kjt)`` returns ``{feature: pooled [B, dim]}`` in the order of
    ``kjt.keys``. Rows live in ``store`` (default: a fresh
    :class:`ps.InProcessStore`); ``group`` (default: :class:`comm.LocalGroup`)
    is the data-parallel group whose row gradients are combined.

    Training (``module.train()`` and grad enabled) pushes row gradients to the
    store during ``backward()``; under ``torch.no_grad()`` or ``.eval()`` forward
    only reads.

    If ``store`` already holds a table of the same name, it is reused when its
    spec is identical (so several modules can share one store) and rejected
    otherwise.
    """

    def __init__(
        self,
        tables: Sequence[TableConfig],
        store: Store | None = None,
        group: ProcessGroup | None = None,
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
        self.store: Store = InProcessStore() if store is None else store
        self.group: ProcessGroup = LocalGroup() if group is None else group
        existing = set(self.store.tables())
        for cfg in tables:
            spec = cfg.to_spec()
            if cfg.name not in existing:
                self.store.create_table(spec)
            elif self.store.spec(cfg.name) != spec:
                raise ValueError(
                    f"EmbeddingCollection: the store already has a table {cfg.name!r} with "
                    f"spec {self.store.spec(cfg.name)}, which differs from {spec}"
                )

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
            f"{c.name}: {c.num_rows}x{c.dim} {c.pooling} {c.feature_names}"
            for c in self._configs.values()
        ]
        return f"tables=[{'; '.join(parts)}], group={self.group!r}"

    # ------------------------------------------------------------ forward

    def forward(self, kjt: KeyedJaggedIds) -> dict[str, torch.Tensor]:
        if not isinstance(kjt, KeyedJaggedIds):
            raise TypeError(
                f"EmbeddingCollection: expected a KeyedJaggedIds, got {type(kjt).__name__}"
            )
        batches = [self._prepare(cfg, feats, kjt) for cfg, feats in self._group_keys(kjt)]
        # Issue every pull before waiting on any, so remote stores overlap them.
        handles = [self.store.pull_async(tb.config.name, tb.unique) for tb in batches]
        train = self.training and torch.is_grad_enabled()
        pusher = _BackwardPush(self, [tb.config.name for tb in batches]) if train else None
        device = kjt.ids.device
        b = kjt.batch_size
        out: dict[str, torch.Tensor] = {}
        for tb, handle in zip(batches, handles, strict=True):
            rows = handle.wait().rows.to(device)  # [U, D]
            if pusher is not None:
                rows.requires_grad_(True)
                rows.register_post_accumulate_grad_hook(pusher.hook(tb.config.name, tb.unique))
            weights = None if tb.weights is None else tb.weights.to(rows.dtype)
            pooled = F.embedding_bag(
                tb.inverse,
                rows,
                tb.offsets,
                mode=tb.config.pooling,
                per_sample_weights=weights,
                include_last_offset=True,
            )  # [F * B, D]; empty bags are zeros
            for i, feat in enumerate(tb.features):
                out[feat] = pooled[i * b : (i + 1) * b]
        return {k: out[k] for k in kjt.keys}

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

    def _prepare(self, cfg: TableConfig, feats: list[str], kjt: KeyedJaggedIds) -> _TableBatch:
        slices = [kjt.key_slice(f) for f in feats]
        ids = torch.cat([s.ids for s in slices])  # [N]
        lengths = torch.cat([s.lengths for s in slices])  # [F * B]
        if ids.numel() > 0:
            bad = (ids < 0) | (ids >= cfg.num_rows)
            if bool(bad.any()):
                pos = int(torch.nonzero(bad)[0, 0])
                sizes = torch.tensor([s.ids.numel() for s in slices]).cumsum(0)
                feat = feats[int(torch.searchsorted(sizes, pos, right=True))]
                raise ValueError(
                    f"EmbeddingCollection: feature {feat!r} has id {int(ids[pos])}, out of "
                    f"range for table {cfg.name!r} with {cfg.num_rows} rows (valid ids "
                    f"[0, {cfg.num_rows}))"
                )
        weights = None
        if kjt.weights is not None:
            if cfg.pooling != "sum":
                raise ValueError(
                    f"EmbeddingCollection: the batch has per-id weights, but table "
                    f"{cfg.name!r} (features {feats}) pools with {cfg.pooling!r}; weights "
                    "need pooling='sum'"
                )
            weights = torch.cat([s.weights for s in slices if s.weights is not None])
        unique, inverse = torch.unique(ids, return_inverse=True)  # [U], [N]
        return _TableBatch(cfg, feats, inverse, unique, offsets_from_lengths(lengths), weights)


class _BackwardPush:
    """Collects one forward's row gradients during backward and pushes them.

    Each table's hook stores its ``(unique ids [U], grads [U, D])``; once every
    table used in the forward has reported, the gradients are pushed in table
    order (all tables of the collection when data parallel, so every rank runs
    the same sequence of collectives even if its batch lacked some table).
    """

    def __init__(self, owner: EmbeddingCollection, used: list[str]) -> None:
        self._owner = owner
        self._used = set(used)
        self._grads: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def hook(self, table: str, unique: torch.Tensor) -> Callable[[torch.Tensor], None]:
        def on_grad(rows: torch.Tensor) -> None:
            grad = rows.grad
            assert grad is not None  # post-accumulate hooks run after .grad is set
            rows.grad = None  # the store owns the update; keep no copy
            self._grads[table] = (unique, grad.detach())
            if set(self._grads) >= self._used:
                self._flush()

        return on_grad

    def _flush(self) -> None:
        owner = self._owner
        group, store = owner.group, owner.store
        grads, self._grads = self._grads, {}
        if group.size == 1:
            for name in owner._configs:
                if name in grads:
                    ids, g = grads[name]
                    store.push(name, ids.cpu(), g.contiguous().cpu())
            return
        for name, cfg in owner._configs.items():
            if name in grads:
                ids, g = grads[name]
                ids, g = ids.cpu().contiguous(), g.cpu().contiguous()
            else:
                ids = torch.empty(0, dtype=torch.int64)
                g = torch.empty(0, cfg.dim, dtype=torch.float32)
            all_ids = group.allgatherv(ids)  # [sum U_r]
            all_grads = group.allgatherv(g)  # [sum U_r, D]
            all_grads.div_(group.size)
            store.push(name, all_ids, all_grads)
