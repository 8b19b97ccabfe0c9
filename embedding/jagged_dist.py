"""Splitting a batch's ids by owner rank for an alltoallv, and the rows back.

The sharded collection exchanges *unique* ids, not bags: each rank deduplicates
every table's ids, sends each unique id once to the rank owning its row, gets
one row back per unique id and pools locally. Every buffer is ordered by rank
(destination, or source on the owner), then table, then unique id::

    2 ranks, tables A (rows 0..9 on rank 0) and B (row-wise: 0..4 on r0, 5..9 on r1)
    unique A = [2, 7]        unique B = [1, 6, 8]        (sorted, from torch.unique)
    send ids    = [ 2, 7,  1  |  1, 3 ]        # local rows: B's 6, 8 are 1, 3 on rank 1
                    A  A   B     B  B
    counts      = [[2, 1],                      # [W, T] ids per (destination, table)
                   [0, 2]]
    send_splits = [3, 2]

Rows come back as one flat buffer in the same order (tables may differ in
width, so chunk ``(rank, table)`` holds ``counts[rank, table] * dim[table]``
elements). Because each table's ranges are owned in rank order, sorted unique ids
are grouped by ascending owner: concatenating table ``t``'s chunks in rank order
gives its rows in unique-id order, with no index to keep (:func:`unpack_rows`).
The owner does the same with the ids it received (:func:`split_ids`) and packs
its answer with :func:`pack_rows`. Gradients travel back in the same layout.

Rows travel as they are stored (:func:`wire_dtype`): float32 tables as float32, fp16
or bf16 ones as 2-byte elements (half the bytes; exact, as they are stored narrow).
Tables of different row types share one buffer of bytes (uint8: every backend moves
it, gloo has no int16), each row moving its own bits::

    tables A (float32, dim 2) and B (fp16, dim 3): wire uint8, widths [8, 6]
    chunk (rank, A): [n_A, 8] bytes = [n_A, 2] float32;  chunk (rank, B): [n_B, 6] = [n_B, 3] fp16

:func:`widen_rows` turns what arrived into the flat float32 buffer of the same
order, with ``counts * dims`` floats per chunk, which is what is pooled.

Everything is tensor code; the only Python loops run over tables and ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from comm import boundary
from embedding.sharding_plan import ShardingPlan


def dedup(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(unique [U] sorted, inverse [N])`` with ``unique[inverse] == ids``."""
    unique, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    return unique, inverse


@dataclass(slots=True)
class IdBuckets:
    """One rank's unique ids bucketed by owner (see the module doc)."""

    send_ids: torch.Tensor  # [S] int64 rows local to the owner, ordered (dest, table, unique)
    counts: torch.Tensor  # [W, T] int64 ids per (destination rank, table)

    @property
    def send_splits(self) -> list[int]:
        """Ids per destination rank ``[W]`` (a host sync when the counts are on a GPU)."""
        return [int(c) for c in boundary.read(self.counts.sum(dim=1))]


def bucketize(
    plan: ShardingPlan, tables: Sequence[str], uniques: Sequence[torch.Tensor]
) -> IdBuckets:
    """Order the unique ids of ``tables`` by owner: ``uniques[t]`` int64 ``[U_t]``,
    sorted ascending and in range (as :func:`dedup` returns them).

    Returns the send buffer of owner-local rows and the ``[W, T]`` counts.
    """
    w, t_count = plan.world_size, len(tables)
    device = uniques[0].device if uniques else torch.device("cpu")
    if t_count == 0:
        empty = torch.empty(0, dtype=torch.int64, device=device)
        return IdBuckets(empty, torch.zeros(w, 0, dtype=torch.int64, device=device))
    keys, local = [], []
    for t, (name, u) in enumerate(zip(tables, uniques, strict=True)):
        o = plan.owner_of(name, u)  # [U_t]
        # Destination-major, then table: the table index is a scalar of the kernel (no
        # per-step tensor of table sizes copied to a device).
        keys.append(o * t_count + t)  # [U_t]
        local.append(plan.local_rows(name, u, o))
    key = torch.cat(keys)  # [S] in (table, unique) order
    order = torch.argsort(key, stable=True)  # [S] buffer slot -> (table, unique) item
    send_ids = torch.cat(local)[order]  # [S]
    # Counts from the sorted keys (bincount on a GPU reads the largest key back first).
    cuts = torch.searchsorted(key[order], torch.arange(w * t_count + 1, device=device))  # [W*T+1]
    counts = (cuts[1:] - cuts[:-1]).view(w, t_count)  # [W, T]
    return IdBuckets(send_ids, counts)


def float_splits(counts: torch.Tensor, dims: torch.Tensor) -> list[int]:
    """Elements per rank ``[W]`` of a flat row buffer with ``counts [W, T]`` rows of
    ``dims [T]`` elements (floats, or wire elements with :func:`wire_widths`)."""
    return [int(x) for x in (counts * dims.unsqueeze(0)).sum(dim=1).tolist()]


def split_ids(ids: torch.Tensor, counts: torch.Tensor) -> list[torch.Tensor]:
    """Per table, the ids of a buffer ordered (rank, table) with ``counts [W, T]``,
    concatenated in rank order: ``[n_t]`` each (views where possible)."""
    w, t_count = counts.shape
    chunks = torch.split(ids, counts.reshape(-1).tolist())  # W * T chunks, (rank, table)
    return [torch.cat([chunks[r * t_count + t] for r in range(w)]) for t in range(t_count)]


def unpack_rows(flat: torch.Tensor, counts: torch.Tensor, dims: torch.Tensor) -> list[torch.Tensor]:
    """Per table ``[n_t, D_t]``: the rows of a flat buffer ordered (rank, table), in rank order.

    For the requester's buffer, table ``t``'s rows come out in the order of its
    sorted unique ids: ranges are owned in rank order, so sorted ids are already
    grouped by ascending owner. Differentiable (split + view + cat).
    """
    w, t_count = counts.shape
    sizes = (counts * dims.unsqueeze(0)).reshape(-1).tolist()  # [W * T] floats per chunk
    chunks = torch.split(flat, sizes)
    d = dims.tolist()
    return [
        torch.cat([chunks[r * t_count + t].view(-1, d[t]) for r in range(w)])
        for t in range(t_count)
    ]


def pack_rows(
    rows: list[torch.Tensor | None],
    counts: torch.Tensor,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The inverse of :func:`unpack_rows`: per table ``[n_t, D_t]`` rows in rank order
    (None for a table with no rows; all of one dtype, :func:`as_wire`) -> one flat
    buffer ordered (rank, table); empty, of ``dtype`` on ``device`` (default: the host),
    when there are no rows at all. ``counts`` ``[W, T]`` are on the host (their values
    are split sizes)."""
    w, t_count = counts.shape
    per_table: list[list[torch.Tensor]] = []
    for t, r in enumerate(rows):
        if r is None:
            assert int(counts[:, t].sum()) == 0, "rows asked of a table without rows"
            per_table.append([])
        else:
            per_table.append(list(torch.split(r, counts[:, t].tolist())))
    parts = [per_table[t][r].reshape(-1) for r in range(w) for t in range(t_count) if per_table[t]]
    if not parts:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.cat(parts)


def wire_dtype(dtypes: Sequence[torch.dtype]) -> torch.dtype:
    """The element type rows travel in: the row type all tables share (float32, float16
    or bfloat16), else bytes (uint8) holding every table's stored bits."""
    kinds = set(dtypes)
    return kinds.pop() if len(kinds) == 1 else torch.uint8


def wire_widths(
    dims: torch.Tensor, dtypes: Sequence[torch.dtype], wire: torch.dtype
) -> torch.Tensor:
    """Wire elements per row ``[T]`` of tables of ``dims [T]`` and row types ``dtypes``."""
    per_element = [t.itemsize // wire.itemsize for t in dtypes]  # 1, or a row type's bytes
    return dims * torch.tensor(per_element, dtype=torch.int64)


def as_wire(rows: torch.Tensor, wire: torch.dtype) -> torch.Tensor:
    """Stored rows ``[n, D]`` as ``[n, D * k]`` wire elements (a view of their bits)."""
    return rows if rows.dtype == wire else rows.view(wire)


def widen_rows(
    flat: torch.Tensor, counts: torch.Tensor, dims: torch.Tensor, dtypes: Sequence[torch.dtype]
) -> torch.Tensor:
    """A wire buffer ordered (rank, table), ``counts [W, T]`` rows of tables of ``dims
    [T]`` stored as ``dtypes`` -> the float32 buffer of the same rows in the same order
    (``counts * dims`` floats per chunk; narrow rows widen exactly)."""
    if flat.dtype == torch.float32:
        return flat
    if flat.dtype != torch.uint8:
        return flat.to(torch.float32)  # every table of this one narrow type
    t_count = counts.shape[1]
    widths = wire_widths(dims, dtypes, flat.dtype)  # [T]
    chunks = torch.split(flat, (counts * widths.unsqueeze(0)).reshape(-1).tolist())
    out = []
    for k, chunk in enumerate(chunks):  # (rank, table) order
        t = k % t_count
        rows = _bits_as(chunk.view(-1, int(widths[t])), dtypes[t])  # [n, D_t]
        out.append(rows.to(torch.float32).reshape(-1))
    return torch.cat(out) if out else flat.new_empty(0, dtype=torch.float32)


def _bits_as(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bytes ``[n, D * k]`` as ``dtype`` ``[n, D]`` (``k`` its size); copied first where
    the chunk does not start on a multiple of ``k`` (a view needs that alignment)."""
    ratio = dtype.itemsize // raw.itemsize
    if ratio > 1 and raw.storage_offset() % ratio:
        raw = raw.clone()
    return raw.view(dtype)
