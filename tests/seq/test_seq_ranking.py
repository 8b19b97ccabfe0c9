"""Full-ranking evaluation (hybridrec.seq.ranking) against references that hold every row.

* One process (a LocalGroup, ``rows_of`` indexing a tensor): the target ranks equal an
  explicit sort of all items (without the excluded ones, the target kept) for chunk sizes
  1, 7, V and more than V; ``topk_items`` equals ``torch.topk``; the tie rule (an item
  scoring exactly as the target does not count); ``rows_of`` called as often as the
  docstring says; no queries; the metrics against numbers worked out by hand; the sums
  add over parts; bad input named in the errors.
* Real ranks (tests/seq/ranks/seq_ranking.py) at 1, 2 and 4 ranks, under mpirun and gloo:
  a table sharded over the ranks, ``rows_of`` a collective fetching rows from their
  owners, a different number of queries per rank (none on one), results equal to the
  one-process reference on the union of the queries.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch import Tensor

import comm
import tests.seq.ranks.seq_ranking as ref
from hybridrec.seq.ranking import (
    metrics_from_sums,
    ranking_metrics,
    ranking_sums,
    target_ranks,
    topk_items,
)
from multiproc import run_ranks
from tolerance import assert_close

pytestmark = pytest.mark.timeout(60)

V, D = ref.V, ref.D


class Counted:
    """``rows_of`` on a whole table in this process, counting its calls."""

    def __init__(self, rows: Tensor) -> None:
        self.rows = rows
        self.calls = 0

    def __call__(self, ids: Tensor) -> Tensor:
        self.calls += 1
        return self.rows[ids]


@pytest.fixture
def group() -> comm.ProcessGroup:
    return comm.LocalGroup()


@pytest.mark.parametrize("chunk", [1, 7, V, V + 13])
@pytest.mark.parametrize("excluding", [True, False], ids=["exclude", "all-items"])
def test_ranks_equal_explicit_sort(group: comm.ProcessGroup, chunk: int, excluding: bool) -> None:
    full = ref.table()
    queries, targets, exclude = ref.rank_data(3)  # 9 queries, some listing their target
    rows_of = Counted(full)
    mine = exclude if excluding else None
    ranks = target_ranks(queries, targets, rows_of, V, group, exclude=mine, chunk=chunk)
    assert torch.equal(ranks, ref.reference_ranks(queries, targets, full, mine))
    assert rows_of.calls == 1 + math.ceil(V / chunk)  # the targets, then the chunks


def test_exclusion_changes_ranks_and_keeps_the_target(group: comm.ProcessGroup) -> None:
    """Excluding the items that outscore a target moves it to rank 0; listing the target
    itself (twice) leaves it ranked; duplicates count once."""
    full = ref.table()
    queries, targets, _ = ref.rank_data(0)
    plain = target_ranks(queries, targets, Counted(full), V, group)
    assert int(plain.max()) > 0
    scores = queries @ full.T
    lists = []
    for j, t in enumerate(targets.tolist()):
        above = torch.nonzero(scores[j] > scores[j, t]).flatten()
        lists.append(torch.cat([above, above[:1], torch.tensor([t, t])]))
    offsets = torch.tensor([0] + [len(x) for x in lists]).cumsum(0)
    exclude = (torch.cat(lists), offsets)
    ranks = target_ranks(queries, targets, Counted(full), V, group, exclude=exclude, chunk=5)
    assert ranks.tolist() == [0] * len(targets)


def test_ties_count_for_the_target(group: comm.ProcessGroup) -> None:
    """Rows equal to the target's score exactly as it does and do not push it down; the
    target's own column (by id) never counts, whatever its rounded score."""
    rows = torch.zeros(10, 4)
    rows[3] = torch.tensor([1.0, 2.0, 0.5, -1.0])
    rows[7] = rows[3]  # a twin of item 3
    rows[8] = 2 * rows[3]  # scores above it for the query below
    query = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    for target, want in ((3, 1), (7, 1), (8, 0), (0, 3)):  # 0: zero score, tied with 6 others
        got = target_ranks(query, torch.tensor([target]), Counted(rows), 10, group, chunk=3)
        assert got.tolist() == [want], target


@pytest.mark.parametrize("chunk", [1, 7, V, V + 13])
@pytest.mark.parametrize("k", [1, 10, V])
def test_topk_equals_torch_topk(group: comm.ProcessGroup, chunk: int, k: int) -> None:
    full = ref.table()
    queries, _, exclude = ref.rank_data(3)
    rows_of = Counted(full)
    for mine in (None, exclude):
        ids, scores = topk_items(queries, k, rows_of, V, group, exclude=mine, chunk=chunk)
        want_ids, want_scores = ref.reference_topk(queries, full, k, mine)
        assert torch.equal(ids, want_ids)
        finite = want_scores > -math.inf
        assert torch.equal(scores > -math.inf, finite)
        assert_close(
            scores[finite],
            want_scores[finite],
            atol=ref.score_tol(queries, full),
            what=f"top-{k} scores, chunk {chunk}",
            why="two float32 dot products of length D",
        )
    assert rows_of.calls == 2 * math.ceil(V / chunk)
    if k == V:  # excluded items fill the tail with id -1
        seen = ref.excluded_sets(exclude, len(queries))
        tails = (ids == -1).sum(1).tolist()
        assert tails == [len(s) for s in seen]


def test_no_queries(group: comm.ProcessGroup) -> None:
    rows_of = Counted(ref.table())
    empty = torch.zeros(0, D)
    ranks = target_ranks(empty, torch.zeros(0, dtype=torch.int64), rows_of, V, group)
    ids, scores = topk_items(empty, 4, rows_of, V, group)
    assert ranks.shape == (0,) and ids.shape == (0, 4) and scores.shape == (0, 4)
    assert rows_of.calls == 0  # every rank sees no query anywhere: none calls rows_of


def test_metrics_by_hand() -> None:
    ranks = torch.tensor([0, 3, 9, 10, 49, 50, 199, 200, 1000])
    got = ranking_metrics(ranks)
    n = 9
    assert got.keys() == {"hr@10", "hr@50", "hr@200", "ndcg@10", "ndcg@200", "mrr"}
    assert got["hr@10"] == pytest.approx(3 / n, abs=1e-15)  # 0, 3, 9
    assert got["hr@50"] == pytest.approx(5 / n, abs=1e-15)  # and 10, 49
    assert got["hr@200"] == pytest.approx(7 / n, abs=1e-15)  # and 50, 199
    ndcg10 = 1 / math.log2(2) + 1 / math.log2(5) + 1 / math.log2(11)
    assert got["ndcg@10"] == pytest.approx(ndcg10 / n, rel=1e-14)
    ndcg200 = ndcg10 + sum(1 / math.log2(r + 2) for r in (10, 49, 50, 199))
    assert got["ndcg@200"] == pytest.approx(ndcg200 / n, rel=1e-14)
    mrr = sum(1 / (r + 1) for r in ranks.tolist())  # not cut: rank 1000 counts too
    assert got["mrr"] == pytest.approx(mrr / n, rel=1e-14)
    one = ranking_metrics(torch.tensor([0]), ks=(1,), ndcg_ks=(1,))
    assert one == {"hr@1": 1.0, "ndcg@1": 1.0, "mrr": 1.0}


def test_sums_add_over_parts() -> None:
    ranks = torch.randint(0, 500, (300,), generator=torch.Generator().manual_seed(1))
    parts = [ranking_sums(p) for p in (ranks[:100], ranks[100:100], ranks[100:])]
    total = torch.stack(parts).sum(0)
    assert total.dtype == torch.float64 and total.shape == (3 + 2 + 2,)
    assert float(total[-1]) == 300.0
    got = metrics_from_sums(total)
    want = ranking_metrics(ranks)
    assert got == pytest.approx(want, rel=1e-14)


def test_errors_name_the_value(group: comm.ProcessGroup) -> None:
    rows_of = Counted(ref.table())
    q = torch.randn(2, D)
    with pytest.raises(ValueError, match=r"targets must be item ids in \[0, 103\), got \[5, 103\]"):
        target_ranks(q, torch.tensor([5, 103]), rows_of, V, group)
    with pytest.raises(ValueError, match=r"targets must be int64 \[2\], got torch.int64 \[3\]"):
        target_ranks(q, torch.tensor([1, 2, 3]), rows_of, V, group)
    with pytest.raises(ValueError, match="chunk must be >= 1 item, got 0"):
        target_ranks(q, torch.tensor([1, 2]), rows_of, V, group, chunk=0)
    bad = (torch.tensor([1, 2, 3]), torch.tensor([0, 2, 1]))
    with pytest.raises(ValueError, match=r"rise from 0 to len\(values\)=3, got \[0, 2, 1\]"):
        target_ranks(q, torch.tensor([1, 2]), rows_of, V, group, exclude=bad)
    with pytest.raises(ValueError, match=r"k must be in \[1, num_items=103\], got 104"):
        topk_items(q, V + 1, rows_of, V, group)
    with pytest.raises(ValueError, match=r"rows_of returned \[2, 3\] for 2 ids; expected \[2, 8\]"):
        target_ranks(q, torch.tensor([1, 2]), lambda ids: torch.zeros(len(ids), 3), V, group)
    with pytest.raises(ValueError, match="ranks must be >= 0, got min -1"):
        ranking_sums(torch.tensor([0, -1]))
    with pytest.raises(ValueError, match="count in sums is 0"):
        metrics_from_sums(ranking_sums(torch.zeros(0, dtype=torch.int64)))
    with pytest.raises(ValueError, match=r"ks must be ints >= 1, got \[10, 0\]"):
        ranking_metrics(torch.tensor([1]), ks=(10, 0))


# ---------------------------------------------------------------- real ranks

LAUNCHES = [(backend, n) for backend in ("mpi", "gloo") for n in (1, 2, 4)]


@pytest.mark.parametrize(("backend", "nprocs"), LAUNCHES, ids=[f"{b}-{n}" for b, n in LAUNCHES])
def test_sharded_rows_equal_one_process(backend: str, nprocs: int) -> None:
    outs = run_ranks("seq_ranking.py", nprocs, backend, timeout=50)
    text = "\n".join(outs)
    found = {int(r): int(n) for r, n in re.findall(r"rank (\d+)/\d+: ok seq ranking (\d+)", text)}
    assert sorted(found) == list(range(nprocs)), text
    assert set(found.values()) == {len(ref.RANK_CASES) + len(ref.TOPK_CASES) + 1}, text
