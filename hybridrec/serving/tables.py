"""An exported table read for serving, and the fused lookup of many tables at once.

Only the rows a batch names are converted to float32 (fp16 -> fp32; int8:
``code * scale + bias``, :func:`decode`); the pooling is the training model's
(:mod:`embedding.fused_ops`): ``embedding_bag(mode="sum")``, "mean" bags as per-id
weights ``1 / len``, so fp32 rows pool to the training forward's bits.

:class:`TableGroup` serves the fixed tables of one dim and one row format together, as
the training model's fused local tables do: one id tensor for all their features (each
id offset by its table's first row), one gather and one ``embedding_bag`` per batch.
Where the rows come from:

* in memory: the tables' rows concatenated once at load into one ``[R, D]`` tensor
  (their stored dtype; int8's ``scale_bias`` into one ``[R, 2]``);
* memory-mapped: the row files as they are, gathered table by table into one
  ``[N, D]`` buffer, optionally through a :class:`HotRows` cache per table;
* Redis (:mod:`hybridrec.serving.redis_rows`): float32 rows pulled per batch.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from embedding import KeyedJaggedIds, TableConfig
from embedding.fused_ops import GroupBatch, group_batch
from embedding.jagged import JaggedIds, offsets_from_lengths
from hybridrec.serving.artefact import ExportReader
from ps import TableSpec
from ps.local.table import table_array


def decode(picked: torch.Tensor, scale_bias: torch.Tensor | None) -> torch.Tensor:
    """float32 ``[N, D]`` of stored rows ``picked [N, D]`` (float32, float16 or uint8
    codes) and, for int8, their ``scale_bias [N, 2]``. One formula for every path (in
    memory, mapped, cached, loaded into Redis), so they all read the same bits."""
    if scale_bias is not None:  # int8: code * scale + bias
        return picked.to(torch.float32) * scale_bias[:, :1] + scale_bias[:, 1:]
    return picked.to(torch.float32)


@dataclass
class ServingTable:
    """One table of an export: ``rows [n, D]`` (float32, float16 or uint8 codes, memory
    mapped), ``scale_bias [n, 2]`` for int8, ``ids [n]`` sorted for a dynamic table."""

    name: str
    dim: int
    num_rows: int | None  # None: a dynamic table (any int64 id)
    dtype: str
    rows: np.ndarray
    scale_bias: np.ndarray | None
    ids: np.ndarray | None
    spec: TableSpec | None  # dynamic tables: the initial rows of ids never trained
    weight: torch.Tensor = field(init=False)
    scale: torch.Tensor | None = field(init=False)

    @classmethod
    def open(cls, reader: ExportReader, name: str, doc: dict[str, Any]) -> ServingTable:
        def mapped(key: str) -> np.ndarray | None:
            return reader.array(doc[key], mmap=True) if doc.get(key) else None

        rows = mapped("rows")
        assert rows is not None
        ids = doc.get("ids")
        table = cls(
            name=name, dim=int(doc["dim"]), num_rows=doc["num_rows"], dtype=doc["dtype"],
            rows=rows, scale_bias=mapped("scale_bias"),
            ids=None if ids is None else reader.array(ids),  # searched every batch: in memory
            spec=None if doc.get("spec") is None else TableSpec.from_json(doc["spec"]),
        )  # fmt: skip
        if rows.ndim != 2 or rows.shape[1] != table.dim:
            raise ValueError(f"export table {name!r}: rows {rows.shape}, expected [n, {table.dim}]")
        return table

    def __post_init__(self) -> None:
        # torch views of the read-only maps (no copy): torch's gathers and dtype
        # conversions are vectorised where numpy's float16 ones are not. Nothing writes
        # through them, so torch's warning about non-writable arrays does not apply.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            self.weight = torch.from_numpy(self.rows)  # [n, D]
            self.scale = None if self.scale_bias is None else torch.from_numpy(self.scale_bias)

    @property
    def nbytes(self) -> int:
        """Bytes of its row files (rows and scale/bias; a dynamic table's ids apart)."""
        return int(self.rows.nbytes + (0 if self.scale_bias is None else self.scale_bias.nbytes))

    def check_ids(self, feature: str, ids: torch.Tensor) -> None:
        """ValueError naming the feature, the table, the first bad id and the range."""
        if self.num_rows is None or ids.numel() == 0:
            return
        bad = (ids < 0) | (ids >= self.num_rows)
        if bool(bad.any()):
            raise_bad_id(feature, self.name, self.num_rows, ids, bad)

    def positions(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(rows [N], unseen [N] bool or None)``: where ``ids`` are in the row files. A
        dynamic table's ids are found by binary search; an id the run never trained is
        flagged (it reads as its initial row, as the store's pull reads it)."""
        if self.ids is None:
            return ids, None
        q = ids.numpy()
        pos = np.minimum(np.searchsorted(self.ids, q), max(len(self.ids) - 1, 0))
        found = (self.ids[pos] == q) if len(self.ids) else np.zeros(len(q), dtype=bool)
        return torch.from_numpy(pos), None if found.all() else torch.from_numpy(~found)

    def decoded(self, pos: torch.Tensor) -> torch.Tensor:
        """float32 ``[N, D]``: the stored rows at positions ``pos [N]``, decoded."""
        picked = self.weight.index_select(0, pos)  # [N, D] stored dtype
        sb = None if self.scale is None else self.scale.index_select(0, pos)  # [N, 2]
        return decode(picked, sb)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 ``[N, D]``: the rows of ``ids`` (int64 ``[N]``, checked), dequantized."""
        ids = ids.cpu()
        if self.weight.shape[0] == 0:  # a dynamic table that kept no rows
            assert self.spec is not None
            return self.spec.initial_rows(ids)
        pos, unseen = self.positions(ids)
        rows = self.decoded(pos)
        if unseen is not None:
            assert self.spec is not None
            rows[unseen] = self.spec.initial_rows(ids[unseen])
        return rows

    def pool(self, bag: JaggedIds, pooling: str) -> torch.Tensor:
        """``[B, D]``: each sample's rows summed ("sum") or averaged ("mean"), with the
        bag's per-id weights if it has them; zeros for an empty bag. The per-feature
        path, for dynamic tables (the fixed ones go through :class:`TableGroup`)."""
        ids, lengths = bag.ids.cpu(), bag.lengths.cpu()
        weights = None if bag.weights is None else bag.weights.cpu().to(torch.float32)
        if pooling == "mean":
            inv = 1.0 / lengths.clamp(min=1).to(torch.float32)  # [B]
            scale = torch.repeat_interleave(inv, lengths, output_size=ids.numel())  # [N]
            weights = scale if weights is None else weights * scale
        if self.ids is None and self.weight.dtype == torch.float32:
            # fp32 rows pooled straight from the map: the training forward's gather+sum
            table, index = self.weight, ids
        else:
            table, index = self.lookup(ids), torch.arange(ids.numel())  # [N, D], [N]
        return F.embedding_bag(
            index,
            table,
            offsets_from_lengths(lengths),
            mode="sum",
            per_sample_weights=weights,
            include_last_offset=True,
        )


def _concat(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``parts`` (``[r_i, W]`` each, one dtype) stacked into one ``[sum r_i, W]`` table."""
    rows = sum(int(p.shape[0]) for p in parts)
    out = table_array((rows, int(parts[0].shape[1])), parts[0].dtype)
    return torch.cat(list(parts), out=out)


def raise_bad_id(
    feature: str, table: str, num_rows: int, ids: torch.Tensor, bad: torch.Tensor
) -> None:
    first = int(ids[bad][0])
    raise ValueError(
        f"feature {feature!r}: id {first} is out of range for table {table!r}, "
        f"whose ids are [0, {num_rows}) ({int(bad.sum())} bad ids in this batch)"
    )


class HotRows:
    """A direct-mapped cache of one memory-mapped table's decoded float32 rows.

    Row ``p`` can only live in slot ``p % slots``: ``tags [slots]`` int64 say which row
    each slot holds (-1: none), ``rows [slots, D]`` float32 its decoded values. A batch
    is looked up in a few whole-tensor ops (no per-row Python, no ordering list as an
    LRU needs); a miss is read from the map, decoded and written into its slot. Rows
    that are often asked for stay in memory as long as no other frequent row shares
    their slot; a decoded row is the same bits as one decoded from the file, so hits and
    misses pool alike. Not thread safe on its own: :class:`TableGroup` holds a lock."""

    def __init__(self, slots: int, dim: int) -> None:
        if not isinstance(slots, int) or isinstance(slots, bool) or slots <= 0:
            raise ValueError(f"hot_rows must be an int > 0 (rows cached per table), got {slots!r}")
        self.slots = slots
        self.tags = torch.full((slots,), -1, dtype=torch.int64)  # [S]
        self.rows = torch.zeros(slots, dim)  # [S, D]
        self.hits = 0
        self.misses = 0

    def lookup(
        self, pos: torch.Tensor, fetch: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """float32 ``[N, D]``: rows ``pos [N]``, the missing ones from ``fetch(pos [M])``."""
        slot = pos % self.slots  # [N]
        hit = self.tags.index_select(0, slot) == pos  # [N]
        n_hit = int(hit.sum())
        self.hits += n_hit
        self.misses += pos.numel() - n_hit
        if n_hit == pos.numel():
            return self.rows.index_select(0, slot)
        miss = ~hit
        want, where = pos[miss], slot[miss]  # [M], [M]
        got = fetch(want)  # [M, D]
        out = self.rows.index_select(0, slot)  # [N, D]; the misses' rows are replaced
        out[miss] = got
        # Two missing rows of one slot: the tag write keeps one of them; only the rows
        # of the kept one are written, so a slot's tag and values always agree.
        self.tags[where] = want
        kept = self.tags.index_select(0, where) == want  # [M]
        self.rows[where[kept]] = got[kept]
        return out


@dataclass
class GroupFeature:
    """A feature served by a group: its index in the dense part's order, its table and
    the first row of that table in the group's concatenated rows."""

    index: int
    name: str
    table: ServingTable
    base: int
    config: TableConfig  # for embedding.fused_ops.group_batch (name, rows, dim, pooling)


# Fetches the float32 rows of one group's batch: (group, ids [N] per feature, batch) ->
# (rows [M, D], index [N] into them).
RowSource = Callable[["TableGroup", Sequence[torch.Tensor]], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class TableGroup:
    """Tables of one dim and one row format, looked up together (fixed ones; dynamic ones
    too when the rows come from Redis).

    ``features`` in the dense part's order; ``in_memory``: the rows concatenated into
    ``weight [R, D]`` (and ``scale [R, 2]`` for int8); otherwise each table's map is
    read, through ``hot`` caches when given. ``source``: rows from elsewhere (Redis)."""

    features: list[GroupFeature]
    dim: int
    dtype: str
    in_memory: bool
    weight: torch.Tensor | None = None  # [R, D] stored dtype, in memory
    scale: torch.Tensor | None = None  # [R, 2] int8, in memory
    hot: dict[str, HotRows] | None = None
    source: RowSource | None = None
    names: list[str] = field(init=False)
    limits: torch.Tensor = field(init=False)  # [K] int64: each feature's table rows
    lock: threading.Lock = field(init=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.names = [f.name for f in self.features]
        # A dynamic table's ids (Redis groups only) are any int64: no bound to check.
        self.fixed = [f.table.num_rows is not None for f in self.features]
        self.limits = torch.tensor(
            [f.table.num_rows or torch.iinfo(torch.int64).max for f in self.features]
        )  # [K]

    @classmethod
    def build(
        cls,
        features: list[tuple[int, str, ServingTable, str]],
        *,
        in_memory: bool,
        hot_rows: int | None = None,
        source: RowSource | None = None,
    ) -> TableGroup:
        """A group of ``(index, feature, table, pooling)``; every table fixed, of one dim
        and dtype. ``in_memory``: copy the rows into one tensor here (one read of the
        files); ``hot_rows``: a :class:`HotRows` of that many slots per mapped table."""
        tables: dict[str, ServingTable] = {}
        for _, _, t, _ in features:
            tables.setdefault(t.name, t)
        bases, start = {}, 0
        for name, t in tables.items():
            bases[name] = start
            start += int(t.weight.shape[0])
        feats = [
            GroupFeature(i, name, t, bases[t.name], TableConfig(
                name=t.name, num_rows=t.num_rows, dim=t.dim, feature_names=[name],
                pooling=pooling, placement="local" if t.num_rows else "hybrid",  # type: ignore[arg-type]
            ))
            for i, name, t, pooling in features
        ]  # fmt: skip
        first = next(iter(tables.values()))
        group = cls(feats, dim=first.dim, dtype=first.dtype, in_memory=in_memory, source=source)
        if source is None and in_memory:
            # One contiguous copy of every table's rows: [R, D] stored dtype, in storage
            # a training table gets (numpy's, with transparent huge pages: random row
            # reads miss the TLB far less; torch's allocator asks for none).
            group.weight = _concat([t.weight for t in tables.values()])
            if first.scale is not None:
                group.scale = _concat([t.scale for t in tables.values() if t.scale is not None])
        elif source is None and hot_rows is not None:
            group.hot = {name: HotRows(hot_rows, first.dim) for name in tables}
        return group

    def check_ids(self, sub: KeyedJaggedIds, starts: list[int]) -> None:
        """ValueError naming the first feature with an id outside its table's rows."""
        ids = sub.ids
        if ids.numel() == 0:
            return
        if not any(self.fixed):
            return
        if all(self.fixed):
            # One range over the whole batch settles it when every id is below the
            # smallest table's rows (one pass over [N], as the training forward checks).
            lo, hi = (int(v) for v in torch.aminmax(ids))
            if lo >= 0 and hi < int(self.limits.min()):
                return
        per_key = torch.tensor([starts[k + 1] - starts[k] for k in range(len(self.features))])
        limit = torch.repeat_interleave(self.limits, per_key, output_size=ids.numel())  # [N]
        bad = (ids >= limit) | (ids < 0)  # [N]
        if not all(self.fixed):  # negative ids of dynamic tables are ids like any other
            dynamic = torch.tensor([not x for x in self.fixed])
            bad &= ~torch.repeat_interleave(dynamic, per_key, output_size=ids.numel())
        if not bool(bad.any()):
            return
        for k, f in enumerate(self.features):
            part, flags = ids[starts[k] : starts[k + 1]], bad[starts[k] : starts[k + 1]]
            if bool(flags.any()):
                assert f.table.num_rows is not None
                raise_bad_id(f.name, f.table.name, f.table.num_rows, part, flags)

    def pool(self, sparse: KeyedJaggedIds) -> torch.Tensor:
        """``[K * B, D]``: bag ``k * B + b`` is feature ``k``'s pooled rows of sample ``b``
        (``sparse`` holds this group's features, in its order, on the CPU)."""
        starts = sparse.key_starts()  # K + 1 host ints
        self.check_ids(sparse, starts)
        feats = [(f.config, f.name) for f in self.features]
        concat = self.source is None and self.in_memory
        # Flat rows of the concatenation (table base added) in memory; else each
        # feature's own table rows. The bags and per-id weights are the training's.
        batch = group_batch(sparse, feats, [f.base if concat else 0 for f in self.features])
        if concat:
            assert self.weight is not None
            if self.dtype == "fp32":
                # The training forward's own call: one embedding_bag over the
                # concatenated tables, the same rows summed in the same order per bag.
                return self._bag(batch.ids, self.weight, batch)
            sb = None if self.scale is None else self.scale.index_select(0, batch.ids)  # [N, 2]
            rows = decode(self.weight.index_select(0, batch.ids), sb)  # [N, D] float32
            return self._bag(torch.arange(rows.shape[0]), rows, batch)
        parts = [batch.ids[starts[k] : starts[k + 1]] for k in range(len(feats))]
        if self.source is not None:
            got, index = self.source(self, parts)  # [M, D], [N]
            return self._bag(index, got, batch)
        rows = self._mapped_rows(parts)
        return self._bag(torch.arange(rows.shape[0]), rows, batch)

    def _mapped_rows(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """float32 ``[N, D]``: the rows of each feature's ids from its table's map
        (through its hot-row cache when there is one), one buffer for the whole group."""
        n = sum(int(p.numel()) for p in parts)
        out = torch.empty(n, self.dim)  # [N, D]
        start = 0
        for f, ids in zip(self.features, parts, strict=True):
            end = start + int(ids.numel())
            if self.hot is not None:
                with self.lock:
                    out[start:end] = self.hot[f.table.name].lookup(ids, f.table.decoded)
            else:
                out[start:end] = f.table.decoded(ids)
            start = end
        return out

    @staticmethod
    def _bag(index: torch.Tensor, rows: torch.Tensor, batch: GroupBatch) -> torch.Tensor:
        return F.embedding_bag(
            index,
            rows,
            batch.offsets,
            mode="sum",
            per_sample_weights=batch.weights,
            include_last_offset=True,
        )

    def cache_stats(self) -> dict[str, dict[str, int]]:
        """``{table: {hits, misses, slots}}`` of the hot-row caches (empty: none)."""
        return {
            name: {"hits": h.hits, "misses": h.misses, "slots": h.slots}
            for name, h in (self.hot or {}).items()
        }
