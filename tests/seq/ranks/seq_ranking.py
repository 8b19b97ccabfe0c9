"""Rank script: full-ranking evaluation over a sharded item table equals one process's.

Every rank holds only its rows of a seeded random table ``[V, D]`` (row ``i`` on rank
``i % size``, the way a sharded embedding spreads ids) and :class:`ShardedRows` fetches
rows from their owners by alltoallv (the counts, the ids, the rows back), a collective
like a sharded lookup. The ranks have different numbers of queries (:data:`QUERIES`, one
rank none) and per-query exclusion lists (with duplicates, and sometimes the target
itself, which must stay ranked). For the chunk sizes of :data:`RANK_CASES` and :data:`TOPK_CASES`:

* :func:`hybridrec.seq.ranking.target_ranks` with exclusion on every rank, on none, or
  on the even ranks only, equals :func:`reference_ranks` (all rows in one tensor, an
  explicit sort) for this rank's queries;
* :func:`~hybridrec.seq.ranking.topk_items` for k = 1, 5 or V equals ``torch.topk`` on
  the materialised scores (ids exactly, scores within two dot products' rounding);
* every rank called ``rows_of`` equally often, as often as the docstring says;
* ``ranking_sums`` added over the ranks give the metrics of the reference ranks of every
  rank's queries (the union, recomputed here from the seeds).

Each rank prints ``rank R/S: ok seq ranking N cases``.

Backend from ``HYBRIDREC_TEST_BACKEND`` (set by tests/support/multiproc.py).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

import comm
from hybridrec.seq.ranking import (
    metrics_from_sums,
    ranking_metrics,
    ranking_sums,
    target_ranks,
    topk_items,
)
from tests.support.tolerance import max_abs_diff, sum_tol

V, D = 103, 8  # 103: not a multiple of 2 or 4, so the ranks' parts differ in size
QUERIES = (6, 0, 3, 9)  # rank r has QUERIES[r % 4] queries
# (chunk, which ranks pass their exclusion lists) for target_ranks, (chunk, k) for
# topk_items: chunk 1, 7 (several per part, the last one short) and more than V (one per
# part). Few cases: a rows_of call is three collectives, on 4 ranks sharing 2 cores.
RANK_CASES = ((1, "all"), (7, "all"), (7, "none"), (V + 50, "even"))
TOPK_CASES = ((7, 1), (7, V), (V + 50, 5))
TABLE_SEED = 5
# The reference ranks' premise: no item scores within this of a query's target, so the
# rounding of two float32 dot products (< 2e-5 here, score_tol) cannot flip a comparison.
MIN_GAP = 1e-4


def table() -> Tensor:
    """The whole item table, float32 [V, D] (the ranks keep only their rows)."""
    return torch.randn(V, D, generator=torch.Generator().manual_seed(TABLE_SEED))


def rank_data(rank: int) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor]]:
    """Rank ``rank``'s queries [B, D], targets [B] and exclusion lists (values, offsets)."""
    gen = torch.Generator().manual_seed(100 + rank)
    b = QUERIES[rank % len(QUERIES)]
    queries = torch.randn(b, D, generator=gen)
    targets = torch.randint(0, V, (b,), generator=gen)
    lists = []
    for j in range(b):
        seen = torch.randint(0, V, (int(torch.randint(0, 12, (1,), generator=gen)),), generator=gen)
        if j % 2 == 0:  # the target listed (it must stay ranked) and a duplicate
            seen = torch.cat([seen, targets[j : j + 1], seen[:1]])
        lists.append(seen)
    lengths = torch.tensor([len(s) for s in lists], dtype=torch.int64)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
    values = torch.cat(lists) if lists else torch.zeros(0, dtype=torch.int64)
    return queries, targets, (values, offsets)


def excluded_sets(exclude: tuple[Tensor, Tensor] | None, b: int) -> list[set[int]]:
    if exclude is None:
        return [set() for _ in range(b)]
    values, offsets = exclude
    return [set(values[offsets[j] : offsets[j + 1]].tolist()) for j in range(b)]


def reference_ranks(
    queries: Tensor, targets: Tensor, rows: Tensor, exclude: tuple[Tensor, Tensor] | None
) -> Tensor:
    """Each target's position in its query's list of items sorted by score, best first,
    without the excluded items (the target kept), ties placing the target first. Checks
    the premise that no other item scores within MIN_GAP of the target."""
    scores = queries.double() @ rows.double().T  # [B, V]
    out = []
    for j, (t, seen) in enumerate(
        zip(targets.tolist(), excluded_sets(exclude, len(targets)), strict=True)
    ):
        keep = [i for i in range(V) if i == t or i not in seen]
        s = scores[j, keep]
        others = torch.tensor([i != t for i in keep])
        gap = float((s[others] - scores[j, t]).abs().min()) if bool(others.any()) else math.inf
        assert gap > MIN_GAP, f"query {j}: an item scores within {gap:.2g} of its target"
        order = sorted(range(len(keep)), key=lambda a: (-float(s[a]), keep[a] != t))
        out.append([keep[a] for a in order].index(t))
    return torch.tensor(out, dtype=torch.int64)


def reference_topk(
    queries: Tensor, rows: Tensor, k: int, exclude: tuple[Tensor, Tensor] | None
) -> tuple[Tensor, Tensor]:
    """torch.topk of the materialised float32 scores, excluded items at -inf (id -1).
    Checks the premise that no two items' scores are within twice :func:`score_tol` (so
    the rounding of another matmul cannot swap two ids)."""
    scores = queries @ rows.T  # [B, V]
    exact = torch.sort(queries.double() @ rows.double().T, dim=1).values
    gap = float((exact[:, 1:] - exact[:, :-1]).min()) if len(queries) else math.inf
    assert gap > 2 * score_tol(queries, rows), f"two items score within {gap:.2g}"
    for j, seen in enumerate(excluded_sets(exclude, len(queries))):
        scores[j, list(seen)] = -math.inf
    top, ids = torch.topk(scores, k, dim=1)
    ids[top == -math.inf] = -1
    return ids, top


def score_tol(queries: Tensor, rows: Tensor) -> float:
    """How far two float32 evaluations of one score ``q · row`` may be apart."""
    magnitude = float((queries.abs() @ rows.abs().T).max()) if len(queries) else 0.0
    return sum_tol(torch.float32, int(rows.shape[1]), magnitude)


class ShardedRows:
    """``rows_of`` over a table spread by ``id % size``: each rank holds its rows only.

    A call sends each id to its owner, the owners answer with the rows (three alltoallv),
    and the rows come back in the order asked: a collective, like a sharded lookup."""

    def __init__(self, group: comm.ProcessGroup, full: Tensor) -> None:
        self.group = group
        self.local = full[group.rank :: group.size].clone()  # rows group.rank, +size, ...
        self.calls = 0

    def __call__(self, ids: Tensor) -> Tensor:
        self.calls += 1
        g = self.group
        validate, g.validate = g.validate, False  # a fixture: spare the checks' collectives
        try:
            return self._fetch(ids)
        finally:
            g.validate = validate

    def _fetch(self, ids: Tensor) -> Tensor:
        g = self.group
        owner = ids % g.size
        order = torch.argsort(owner, stable=True)
        send = torch.bincount(owner, minlength=g.size)  # [size]
        recv = g.alltoallv(send, [1] * g.size)  # [size]: what each peer asks of me
        asked = g.alltoallv(ids[order].contiguous(), send.tolist(), recv.tolist())
        answers = self.local[asked // g.size].contiguous()  # [sum(recv), D]
        got = g.alltoallv(answers, recv.tolist(), send.tolist())  # [len(ids), D]
        out = torch.empty(len(ids), D)
        out[order] = got
        return out


def run(group: comm.ProcessGroup, args: list[str]) -> None:
    """Every case on ``group``; no arguments."""
    rank, size = group.rank, group.size
    full = table()
    rows_of = ShardedRows(group, full)
    everyone = [rank_data(r) for r in range(size)]
    queries, targets, exclude = everyone[rank]
    got = rows_of(torch.arange(V))  # the fixture itself: every row from its owner
    assert torch.equal(got, full), f"rank {rank}: ShardedRows returned other rows"
    longest = max((r + 1) * V // size - r * V // size for r in range(size))
    cases = 0
    for chunk, who in RANK_CASES:
        mine = exclude if who == "all" or (who == "even" and rank % 2 == 0) else None
        before = rows_of.calls
        ranks = target_ranks(queries, targets, rows_of, V, group, exclude=mine, chunk=chunk)
        calls = rows_of.calls - before
        assert calls == 1 + -(-longest // chunk), f"rank {rank} chunk {chunk}: {calls} calls"
        want = reference_ranks(queries, targets, full, mine)
        assert torch.equal(ranks, want), f"rank {rank} chunk {chunk} {who}: {ranks} != {want}"
        cases += 1
    for chunk, k in TOPK_CASES:
        before = rows_of.calls
        ids, scores = topk_items(queries, k, rows_of, V, group, exclude=exclude, chunk=chunk)
        calls = rows_of.calls - before
        assert calls == -(-longest // chunk), f"rank {rank} chunk {chunk}: {calls} calls"
        want_ids, want_scores = reference_topk(queries, full, k, exclude)
        assert torch.equal(ids, want_ids), f"rank {rank} chunk {chunk} k {k}: ids differ"
        finite = want_scores > -math.inf
        assert torch.equal(finite, scores > -math.inf), f"rank {rank}: -inf tails differ"
        off, tol = max_abs_diff(scores[finite], want_scores[finite]), score_tol(queries, full)
        assert off <= tol, f"rank {rank} chunk {chunk} top-{k}: scores off by {off:.3g} > {tol:.3g}"
        cases += 1
    per_rank = group.allgather(torch.tensor([rows_of.calls])).flatten().tolist()
    assert len(set(per_rank)) == 1, f"rows_of calls per rank: {per_rank}"
    # Metrics: this rank's sums, added over ranks, against the union's reference ranks.
    ranks = target_ranks(queries, targets, rows_of, V, group, exclude=exclude, chunk=7)
    ks, ndcg_ks = (1, 10, 50), (10, 50)
    sums = group.allreduce(ranking_sums(ranks, ks, ndcg_ks))
    union = torch.cat([reference_ranks(q, t, full, e) for q, t, e in everyone])
    want_metrics = ranking_metrics(union, ks, ndcg_ks)
    got_metrics = metrics_from_sums(sums, ks, ndcg_ks)
    assert got_metrics.keys() == want_metrics.keys()
    for name, value in want_metrics.items():
        assert math.isclose(got_metrics[name], value, rel_tol=1e-12), (name, got_metrics)
    cases += 1
    print(f"rank {rank}/{size}: ok seq ranking {cases} cases", flush=True)


if __name__ == "__main__":  # tests may import this file for its helpers
    from tests.support.ranks.rank_main import run_main

    run_main(run)
