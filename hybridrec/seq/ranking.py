"""Full-ranking evaluation of a next-item recommender, without the table in one process.

A query ``q [D]`` (the hidden vector at a predicted position) scores item ``i`` as
``q · row_i``. The item table ``[V, D]`` may be sharded or in a parameter server, so
the functions here see it only through ``rows_of``: item ids ``[n]`` in, their rows
``[n, D]`` out. ``rows_of`` is a collective for a sharded table: every rank calls it the
same number of times, in the same order, possibly with other ids or none.

How :func:`target_ranks` and :func:`topk_items` split the work over ``group``::

    all queries        allgatherv: every rank's [B_r, D] queries (B_r may be 0),
                       targets and excluded items -> [G, D], G = sum B_r
    item ids 0..V-1    rank r owns [r V / size, (r+1) V / size) and scores it
                       against all G queries, ``chunk`` items per rows_of call
                       (ranks with fewer chunks call rows_of with no ids)
    combine            target_ranks: one allreduce(sum) of the G counts
                       topk_items:   alltoallv: rank r gets every rank's k best
                                     for its own queries, and merges them
    result             each rank keeps the rows of its own queries

Memory per rank: one chunk's rows ``[chunk, D]`` and scores of at most 2**24 (query,
item) pairs at a time. Scores are float32 matmuls; :func:`ranking_metrics` (or
:func:`ranking_sums` and :func:`metrics_from_sums`, to add over ranks first) turns the
target ranks into HR@K, NDCG@K and MRR.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from comm import ProcessGroup

RowsOf = Callable[[Tensor], Tensor]
"""Item ids int64 ``[n]`` -> their rows float ``[n, D]`` on the caller's device; a
collective for sharded tables (see the module docstring)."""

Exclude = tuple[Tensor, Tensor]
"""``(values [M], offsets [B+1])``: query ``b``'s items to leave out are
``values[offsets[b]:offsets[b+1]]`` (duplicates allowed)."""

SCORE_DTYPE = torch.float32
# The most (query, item) scores held at once: 2**24 float32 = 64 MiB.
BLOCK_SCORES = 1 << 24


@dataclass(frozen=True, slots=True)
class _Gathered:
    """Every rank's queries, gathered: what each rank scores its items against."""

    queries: Tensor  # [G, D] float32
    targets: Tensor | None  # [G] int64 (target_ranks)
    excl_query: Tensor  # [P] int64 index into the G queries, sorted by excl_item
    excl_item: Tensor  # [P] int64 item ids in this rank's part, sorted
    sizes: list[int]  # every rank's number of queries
    first: int  # this rank's first query among the G
    count: int  # this rank's number of queries
    lo: int  # this rank's items: [lo, hi)
    hi: int
    calls: int  # rows_of calls for the parts, the same on every rank


def _local_checks(
    what: str,
    queries: Tensor,
    targets: Tensor | None,
    num_items: int,
    exclude: Exclude | None,
    chunk: int,
    k: int,
) -> None:
    if num_items < 1:
        raise ValueError(f"{what}: num_items must be >= 1, got {num_items}")
    if chunk < 1:
        raise ValueError(f"{what}: chunk must be >= 1 item, got {chunk}")
    if k != -1 and not 1 <= k <= num_items:
        raise ValueError(f"{what}: k must be in [1, num_items={num_items}], got {k}")
    if queries.dim() != 2 or not queries.is_floating_point():
        raise ValueError(
            f"{what}: queries must be float [B, D], got {queries.dtype} {list(queries.shape)}"
        )
    b = int(queries.shape[0])

    def ids(name: str, t: Tensor, n: int | None) -> None:
        if t.dtype != torch.int64 or t.dim() != 1 or (n is not None and t.numel() != n):
            want = f"[{n}]" if n is not None else "[n]"
            raise ValueError(f"{what}: {name} must be int64 {want}, got {t.dtype} {list(t.shape)}")
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= num_items):
            raise ValueError(
                f"{what}: {name} must be item ids in [0, {num_items}), got "
                f"[{int(t.min())}, {int(t.max())}]"
            )

    if targets is not None:
        ids("targets", targets, b)
    if exclude is not None:
        values, offsets = exclude
        ids("exclude values", values, None)
        if offsets.dtype != torch.int64 or offsets.shape != (b + 1,):
            raise ValueError(
                f"{what}: exclude offsets must be int64 [B+1={b + 1}], got "
                f"{offsets.dtype} {list(offsets.shape)}"
            )
        o = offsets.tolist()
        falls = bool((offsets[1:] < offsets[:-1]).any())
        if o[0] != 0 or o[-1] != values.numel() or falls:
            raise ValueError(
                f"{what}: exclude offsets must rise from 0 to len(values)={values.numel()}, "
                f"got {o[:8]}{' ...' if len(o) > 8 else ''}"
            )


def _gather(
    what: str,
    queries: Tensor,
    targets: Tensor | None,
    num_items: int,
    group: ProcessGroup,
    exclude: Exclude | None,
    chunk: int,
    k: int = -1,
) -> _Gathered:
    """Check the arguments on every rank, then gather every rank's queries.

    The first collective carries each rank's verdict and sizes, so bad input on any rank
    raises ``ValueError`` on every rank instead of leaving its peers waiting.
    """
    error: ValueError | None = None
    try:
        _local_checks(what, queries, targets, num_items, exclude, chunk, k)
    except ValueError as e:
        error = e
    d = int(queries.shape[1]) if queries.dim() == 2 else -1
    b = int(queries.shape[0]) if queries.dim() >= 1 else 0
    row = [int(error is not None), b, d, num_items, chunk, k, int(exclude is not None)]
    table = group.allgather(torch.tensor(row, dtype=torch.int64)).tolist()  # [size, 7]
    if error is not None:
        raise error
    bad = [r for r, t in enumerate(table) if t[0]]
    if bad:
        raise ValueError(f"{what}: rank(s) {bad} passed bad input (see their error)")
    for name, col in (("D", 2), ("num_items", 3), ("chunk", 4), ("k", 5)):
        per_rank = [t[col] for t in table]
        if len(set(per_rank)) != 1:
            raise ValueError(f"{what}: ranks disagree on {name}: {per_rank} (one per rank)")
    sizes = [t[1] for t in table]
    device = queries.device
    q_all = group.allgatherv(queries.to(SCORE_DTYPE).contiguous())  # [G, D]
    t_all = None if targets is None else group.allgatherv(targets.to(device).contiguous())
    lo = group.rank * num_items // group.size
    hi = (group.rank + 1) * num_items // group.size
    empty = torch.empty(0, dtype=torch.int64, device=device)
    excl_query, excl_item = empty, empty
    if any(t[6] for t in table):  # some rank excludes items: every rank gathers
        if exclude is None:
            values, lengths = empty, torch.zeros(b, dtype=torch.int64, device=device)
        else:
            values, offsets = exclude
            lengths = (offsets[1:] - offsets[:-1]).to(device)
        all_lengths = group.allgatherv(lengths.contiguous())  # [G]
        all_values = group.allgatherv(values.to(device).contiguous())  # [sum M_r]
        owner = torch.repeat_interleave(torch.arange(sum(sizes), device=device), all_lengths)
        keep = (all_values >= lo) & (all_values < hi)
        if t_all is not None:  # the target itself is never excluded
            keep &= all_values != t_all[owner]
        excl_item, order = torch.sort(all_values[keep], stable=True)
        excl_query = owner[keep][order]
    longest = max(
        (r + 1) * num_items // group.size - r * num_items // group.size for r in range(group.size)
    )
    return _Gathered(
        queries=q_all,
        targets=t_all,
        excl_query=excl_query,
        excl_item=excl_item,
        sizes=sizes,
        first=sum(sizes[: group.rank]),
        count=b,
        lo=lo,
        hi=hi,
        calls=-(-longest // chunk),
    )


def _fetch(rows_of: RowsOf, ids: Tensor, d: int) -> Tensor:
    rows = rows_of(ids)
    if rows.shape != (ids.numel(), d):
        raise ValueError(
            f"rows_of returned {list(rows.shape)} for {ids.numel()} ids; expected "
            f"[{ids.numel()}, {d}]"
        )
    return rows.to(device=ids.device, dtype=SCORE_DTYPE)


def _chunks(g: _Gathered, rows_of: RowsOf, chunk: int) -> Iterator[tuple[int, int, Tensor]]:
    """``(lo, hi, rows [hi - lo, D])`` for this rank's items ``chunk`` at a time, calling
    ``rows_of`` ``g.calls`` times (with no ids once this rank's items are done)."""
    device = g.queries.device
    d = int(g.queries.shape[1])
    for call in range(g.calls):
        lo = min(g.lo + call * chunk, g.hi)
        hi = min(lo + chunk, g.hi)
        rows = _fetch(rows_of, torch.arange(lo, hi, dtype=torch.int64, device=device), d)
        if hi > lo:
            yield lo, hi, rows


def _query_blocks(total: int, items: int) -> Iterator[tuple[int, int]]:
    """``(q0, q1)``: the gathered queries in blocks of at most BLOCK_SCORES scores."""
    step = max(1, BLOCK_SCORES // max(items, 1))
    for q0 in range(0, total, step):
        yield q0, min(q0 + step, total)


def _excluded_in(g: _Gathered, lo: int, hi: int, q0: int, q1: int) -> tuple[Tensor, Tensor]:
    """The excluded (query - q0, item - lo) pairs with item in [lo, hi), query in [q0, q1)."""
    a = int(torch.searchsorted(g.excl_item, lo))
    z = int(torch.searchsorted(g.excl_item, hi))
    qs, its = g.excl_query[a:z], g.excl_item[a:z]
    inside = (qs >= q0) & (qs < q1)
    return qs[inside] - q0, its[inside] - lo


def target_ranks(
    queries: Tensor,
    targets: Tensor,
    rows_of: RowsOf,
    num_items: int,
    group: ProcessGroup,
    *,
    exclude: Exclude | None = None,
    chunk: int = 65536,
) -> Tensor:
    """The rank of each query's target among all items: int64 ``[B]``, 0 = ranked first.

    ``queries [B, D]``, ``targets`` int64 ``[B]``; ``B`` may differ between ranks and be
    0. The rank of target ``t`` for query ``q`` is the number of items ``i``, other than
    ``t`` and the query's excluded items, with ``q · row_i > q · row_t`` STRICTLY: ties
    count in the target's favour (an item scoring exactly as the target does not push it
    down; beware that a model scoring every item alike then ranks every target first).
    ``exclude`` (values, offsets) lists items per query to leave out (seen items); the
    target is never left out, even when listed. The target is left out of the count by
    its id, so its own score from a chunk never counts against it; the scores of other
    items are float32 matmuls and the target's a float32 dot product, which may differ
    in the last bit for an item of (mathematically) equal score.

    Collective over ``group``; calls ``rows_of`` once for every gathered target, then
    ``ceil(ceil(num_items / size) / chunk)`` times for the items (every rank alike).
    """
    what = "target_ranks"
    g = _gather(what, queries, targets, num_items, group, exclude, chunk)
    total = int(g.queries.shape[0])
    if total == 0:  # no rank has a query: no rank calls rows_of
        return torch.empty(0, dtype=torch.int64, device=queries.device)
    assert g.targets is not None
    d = int(g.queries.shape[1])
    target_rows = _fetch(rows_of, g.targets, d)  # [G, D]
    target_score = (g.queries * target_rows).sum(1)  # [G]
    counts = torch.zeros(total, dtype=torch.int64, device=g.queries.device)  # [G]
    for lo, hi, rows in _chunks(g, rows_of, chunk):
        for q0, q1 in _query_blocks(total, hi - lo):
            above = g.queries[q0:q1] @ rows.T > target_score[q0:q1, None]  # [q, c] bool
            t = g.targets[q0:q1] - lo
            own = torch.nonzero((t >= 0) & (t < hi - lo)).flatten()
            above[own, t[own]] = False  # the target itself, by id
            eq, ei = _excluded_in(g, lo, hi, q0, q1)
            above[eq, ei] = False  # duplicates clear the same cell once
            counts[q0:q1] += above.sum(1)
    group.allreduce(counts, "sum")
    return counts[g.first : g.first + g.count]


def topk_items(
    queries: Tensor,
    k: int,
    rows_of: RowsOf,
    num_items: int,
    group: ProcessGroup,
    *,
    exclude: Exclude | None = None,
    chunk: int = 65536,
) -> tuple[Tensor, Tensor]:
    """The ``k`` best items per query: ids int64 ``[B, k]`` and scores float32 ``[B, k]``,
    best first.

    Each rank keeps the running top ``k`` of its items for every gathered query, then
    sends each rank the bests for that rank's queries (one alltoallv of scores, one of
    ids), which it merges: the table is never in one process, and what a rank receives
    is ``size * B * k`` scores and ids.
    ``exclude`` as in :func:`target_ranks`; a query with fewer than ``k`` items left
    gets id -1 and score -inf in the tail. Exactly equal scores come in torch.topk's
    order (unspecified).
    """
    what = "topk_items"
    g = _gather(what, queries, None, num_items, group, exclude, chunk, k)
    total = int(g.queries.shape[0])
    device = g.queries.device
    if total == 0:
        return (
            torch.empty(0, k, dtype=torch.int64, device=device),
            torch.empty(0, k, dtype=SCORE_DTYPE, device=device),
        )
    best = torch.full((total, k), -math.inf, dtype=SCORE_DTYPE, device=device)  # [G, k]
    best_id = torch.full((total, k), -1, dtype=torch.int64, device=device)
    for lo, hi, rows in _chunks(g, rows_of, chunk):
        ids = torch.arange(lo, hi, dtype=torch.int64, device=device)
        for q0, q1 in _query_blocks(total, hi - lo):
            scores = g.queries[q0:q1] @ rows.T  # [q, c]
            eq, ei = _excluded_in(g, lo, hi, q0, q1)
            scores[eq, ei] = -math.inf
            both = torch.cat([best[q0:q1], scores], 1)  # [q, k + c]
            both_id = torch.cat([best_id[q0:q1], ids.expand(q1 - q0, -1)], 1)
            top, at = torch.topk(both, k, dim=1)
            best[q0:q1], best_id[q0:q1] = top, both_id.gather(1, at)
    # Each rank's bests for rank r's queries go to rank r: [size * B, k], peer by peer.
    back = [g.count] * group.size
    all_best = group.alltoallv(best, g.sizes, back).view(group.size, g.count, k)
    all_id = group.alltoallv(best_id, g.sizes, back).view(group.size, g.count, k)
    merged = all_best.permute(1, 0, 2).reshape(g.count, group.size * k)  # [B, size * k]
    merged_id = all_id.permute(1, 0, 2).reshape(g.count, group.size * k)
    top, at = torch.topk(merged, k, dim=1)
    top_id = merged_id.gather(1, at)
    top_id[top == -math.inf] = -1
    return top_id, top


# ---------------------------------------------------------------- metrics


def _check_ks(ks: Sequence[int], ndcg_ks: Sequence[int]) -> None:
    for name, values in (("ks", ks), ("ndcg_ks", ndcg_ks)):
        if any(not isinstance(x, int) or x < 1 for x in values):
            raise ValueError(f"{name} must be ints >= 1, got {list(values)}")


def ranking_sums(
    ranks: Tensor, ks: Sequence[int] = (10, 50, 200), ndcg_ks: Sequence[int] = (10, 200)
) -> Tensor:
    """float64 ``[len(ks) + len(ndcg_ks) + 2]``: over the given target ranks, the sums of
    HR@K for each of ``ks``, of NDCG@K for each of ``ndcg_ks``, of the reciprocal rank,
    then their number. Add them over ranks (``group.allreduce(sums)``), then
    :func:`metrics_from_sums`.

    With one relevant item per query: HR@K = [rank < K]; NDCG@K = 1 / log2(rank + 2)
    if rank < K else 0 (its ideal DCG is 1); RR = 1 / (rank + 1), not cut at any K.
    """
    _check_ks(ks, ndcg_ks)
    if ranks.dim() != 1 or ranks.dtype != torch.int64:
        raise ValueError(f"ranks must be int64 [n], got {ranks.dtype} {list(ranks.shape)}")
    if ranks.numel() and int(ranks.min()) < 0:
        raise ValueError(f"ranks must be >= 0, got min {int(ranks.min())}")
    r = ranks.to(torch.float64)
    gain = 1.0 / torch.log2(r + 2.0)
    parts = [(r < k).sum(dtype=torch.float64) for k in ks]
    parts += [torch.where(r < k, gain, 0.0).sum() for k in ndcg_ks]
    parts += [(1.0 / (r + 1.0)).sum(), torch.tensor(float(r.numel()), dtype=torch.float64)]
    return torch.stack([p.to(ranks.device) for p in parts])


def metrics_from_sums(
    sums: Tensor, ks: Sequence[int] = (10, 50, 200), ndcg_ks: Sequence[int] = (10, 200)
) -> dict[str, float]:
    """``{"hr@K": .., "ndcg@K": .., "mrr": ..}``: the means of :func:`ranking_sums`' sums
    (made with the same ``ks`` and ``ndcg_ks``)."""
    _check_ks(ks, ndcg_ks)
    want = len(ks) + len(ndcg_ks) + 2
    if sums.shape != (want,):
        raise ValueError(
            f"sums must be [{want}] for ks={list(ks)}, ndcg_ks={list(ndcg_ks)}; got "
            f"{list(sums.shape)}"
        )
    values = sums.tolist()
    n = values[-1]
    if n <= 0:
        raise ValueError(f"no ranks to average: the count in sums is {n}")
    names = [f"hr@{k}" for k in ks] + [f"ndcg@{k}" for k in ndcg_ks] + ["mrr"]
    return {name: v / n for name, v in zip(names, values[:-1], strict=True)}


def ranking_metrics(
    ranks: Tensor, ks: Sequence[int] = (10, 50, 200), ndcg_ks: Sequence[int] = (10, 200)
) -> dict[str, float]:
    """HR@K, NDCG@K and MRR averaged over ``ranks`` (see :func:`ranking_sums`)."""
    return metrics_from_sums(ranking_sums(ranks, ks, ndcg_ks), ks, ndcg_ks)
