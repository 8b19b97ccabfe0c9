"""ShardingPlan (who owns which rows) and jagged_dist (ids and rows split by owner).

The exchange itself is simulated here in one process: ``simulated_alltoallv``
does what an alltoallv does with every rank's buffer in hand, so the split /
look-up / scatter-back bookkeeping is checked against a plain gather from the
whole table. Real multi-rank exchanges are in tests/embedding/test_embedding_sharded.py.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ps
from embedding.config import TableConfig
from embedding.jagged_dist import (
    bucketize,
    dedup,
    float_splits,
    pack_rows,
    split_ids,
    unpack_rows,
)
from embedding.sharding_plan import ShardingPlan, TableShards


def cfg(name: str, rows: int, dim: int = 4, opt: ps.Optimizer | None = None) -> TableConfig:
    return TableConfig(
        name=name, num_rows=rows, dim=dim, feature_names=[f"{name}_f"], placement="sharded",
        optimizer=opt or ps.SGD(lr=0.1),
    )  # fmt: skip


# ------------------------------------------------------------------ plan


def test_table_wise_greedy_balance() -> None:
    # SGD: 16 bytes per row at dim 4. Largest first, each to the lightest rank.
    cfgs = [cfg("a", 100), cfg("b", 60), cfg("c", 50), cfg("d", 40), cfg("e", 10)]
    plan = ShardingPlan.build(cfgs, 2, row_wise_threshold_rows=None)
    owners = {t.name: t.owners for t in plan.tables}
    # a -> 0 (100); b -> 1 (60); c -> 1 (110); d -> 0 (140); e -> 1 (120)
    assert owners == {"a": [0], "b": [1], "c": [1], "d": [0], "e": [1]}
    assert plan.bytes_per_rank(cfgs) == [140 * 16, 120 * 16]
    assert not any(t.row_wise for t in plan.tables)


def test_balance_counts_optimizer_state() -> None:
    # RowWiseAdagrad adds one float per row, Adam 2 * dim + 1.
    cfgs = [cfg("adam", 100, opt=ps.Adam()), cfg("sgd1", 150), cfg("sgd2", 140)]
    plan = ShardingPlan.build(cfgs, 2, row_wise_threshold_rows=None)
    # adam: 100 * 4 * (4 + 9) = 5200 bytes; sgd1 2400; sgd2 2240 -> both sgd on rank 1.
    assert plan.table("adam").owners == [0]
    assert plan.table("sgd1").owners == plan.table("sgd2").owners == [1]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(1, 500), min_size=1, max_size=12),
    st.integers(1, 6),
)
def test_greedy_is_within_one_table_of_the_mean(rows: list[int], world: int) -> None:
    cfgs = [cfg(f"t{i}", n) for i, n in enumerate(rows)]
    plan = ShardingPlan.build(cfgs, world, row_wise_threshold_rows=None)
    load = plan.bytes_per_rank(cfgs)
    biggest = max(rows) * 16
    assert sum(load) == sum(rows) * 16
    assert max(load) <= sum(load) / world + biggest  # the greedy (LPT) bound


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 1000), st.integers(1, 9))
def test_row_wise_ranges_cover_every_row_once(rows: int, world: int) -> None:
    plan = ShardingPlan.build([cfg("big", rows)], world, row_wise_threshold_rows=1)
    t = plan.table("big")
    covered = torch.cat([torch.arange(*t.rows_on(r)) for r in range(world)])
    assert torch.equal(covered, torch.arange(rows))  # in rank order, each row once
    sizes = [t.rows_on(r)[1] - t.rows_on(r)[0] for r in range(world)]
    assert max(sizes) - min(sizes) <= (0 if rows % world == 0 else 1)
    assert t.row_wise == (world > 1 and rows > 1)


def test_threshold_picks_row_wise_tables() -> None:
    cfgs = [cfg("small", 50), cfg("big", 51), cfg("other", 10)]
    plan = ShardingPlan.build(cfgs, 3, row_wise_threshold_rows=50)
    assert plan.table("big").bounds == (0, 17, 34, 51)
    assert not plan.table("small").row_wise and not plan.table("other").row_wise
    # The row-wise table loads every rank by 17 rows, then small -> 0, other -> 1.
    assert plan.table("small").owners == [0] and plan.table("other").owners == [1]
    text = plan.describe()
    assert "big 51x4 row-wise" in text and "small 50x4 table-wise on rank 0" in text
    # One rank: nothing to split.
    assert not ShardingPlan.build(cfgs, 1, row_wise_threshold_rows=1).table("big").row_wise


def test_deterministic_and_independent_of_config_order() -> None:
    rng = random.Random(3)
    cfgs = [cfg(f"t{i}", rng.randint(1, 300), dim=rng.choice([2, 4, 8])) for i in range(15)]
    plan = ShardingPlan.build(cfgs, 4, row_wise_threshold_rows=250)
    assert plan == ShardingPlan.build(cfgs, 4, row_wise_threshold_rows=250)
    shuffled = list(cfgs)
    rng.shuffle(shuffled)
    other = ShardingPlan.build(shuffled, 4, row_wise_threshold_rows=250)
    assert {t.name: t.bounds for t in other.tables} == {t.name: t.bounds for t in plan.tables}
    assert other.fingerprint() != plan.fingerprint()  # table order differs, so plans differ


def test_owner_and_local_rows_match_a_loop() -> None:
    cfgs = [cfg("a", 23), cfg("b", 5)]
    plan = ShardingPlan.from_bounds(cfgs, {"a": [0, 7, 7, 20, 23], "b": [0, 0, 5, 5, 5]})
    ids = torch.arange(23)
    owner = plan.owner_of("a", ids)
    local = plan.local_rows("a", ids, owner)
    b = plan.table("a").bounds
    for i in range(23):
        r = next(r for r in range(4) if b[r] <= i < b[r + 1])
        assert (int(owner[i]), int(local[i])) == (r, i - b[r])
    assert plan.owner_of("b", torch.arange(5)).tolist() == [1] * 5
    assert plan.table("a").owners == [0, 2, 3]


def test_plan_errors_name_the_numbers() -> None:
    with pytest.raises(ValueError, match="world_size must be an int >= 1, got 0"):
        ShardingPlan.build([cfg("a", 3)], 0)
    with pytest.raises(ValueError, match="row_wise_threshold_rows .* got 0"):
        ShardingPlan.build([cfg("a", 3)], 2, row_wise_threshold_rows=0)
    with pytest.raises(ValueError, match=r"table names \['a'\] appear more than once"):
        ShardingPlan.build([cfg("a", 3), cfg("a", 4)], 2)
    with pytest.raises(TypeError, match="expected TableConfig"):
        ShardingPlan.build(["a"], 2)  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"row bounds \[0, 5, 3\] must not decrease"):
        TableShards(name="a", num_rows=3, dim=2, bounds=(0, 5, 3))
    with pytest.raises(ValueError, match="must start at 0 and end at num_rows=3"):
        TableShards(name="a", num_rows=3, dim=2, bounds=(0, 2))
    with pytest.raises(ValueError, match=r"no bounds for tables \['b'\]"):
        ShardingPlan.from_bounds([cfg("a", 3), cfg("b", 3)], {"a": [0, 3]})
    with pytest.raises(ValueError, match="same number of ranges"):
        ShardingPlan.from_bounds([cfg("a", 3), cfg("b", 3)], {"a": [0, 3], "b": [0, 1, 3]})
    with pytest.raises(KeyError, match="no table 'zz'"):
        ShardingPlan.build([cfg("a", 3)], 1).table("zz")


# ------------------------------------------------------------------ jagged_dist


def simulated_alltoallv(buffers: list[torch.Tensor], splits: list[list[int]]) -> list[torch.Tensor]:
    """What ``alltoallv`` gives every rank: rank r receives chunk r of every sender, in order."""
    w = len(buffers)
    chunks = [list(torch.split(buffers[p], splits[p])) for p in range(w)]
    return [torch.cat([chunks[p][r] for p in range(w)]) for r in range(w)]


def test_dedup_inverse() -> None:
    ids = torch.tensor([5, 1, 5, 9, 1, 1])
    u, inv = dedup(ids)
    assert u.tolist() == [1, 5, 9] and torch.equal(u[inv], ids)


def test_bucketize_example_from_the_docstring() -> None:
    cfgs = [cfg("A", 10), cfg("B", 10)]
    plan = ShardingPlan.from_bounds(cfgs, {"A": [0, 10, 10], "B": [0, 5, 10]})
    bk = bucketize(plan, ["A", "B"], [torch.tensor([2, 7]), torch.tensor([1, 6, 8])])
    assert bk.send_ids.tolist() == [2, 7, 1, 1, 3]
    assert bk.counts.tolist() == [[2, 1], [0, 2]]
    assert bk.send_splits == [3, 2]
    assert [t.tolist() for t in split_ids(bk.send_ids, bk.counts)] == [[2, 7], [1, 1, 3]]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_round_trip_through_simulated_exchange(world: int) -> None:
    """Every rank's unique ids reach their owners, the owners' rows come back in
    unique-id order, and the gradients sent back land on the right rows."""
    gen = torch.Generator().manual_seed(world)
    cfgs = [cfg("a", 37, dim=3), cfg("b", 11, dim=5), cfg("c", 64, dim=2)]
    plan = ShardingPlan.build(cfgs, world, row_wise_threshold_rows=40)
    assert world == 1 or plan.table("c").row_wise
    names = [c.name for c in cfgs]
    dims = torch.tensor([c.dim for c in cfgs])
    full = {c.name: torch.randn(c.num_rows or 0, c.dim, generator=gen) for c in cfgs}
    # Each rank asks for random ids (repeats; table "b" missing on rank 0).
    uniques, buckets = [], []
    for r in range(world):
        per = []
        for c in cfgs:
            n = 0 if (r == 0 and c.name == "b") else 20
            per.append(dedup(torch.randint(0, c.num_rows or 1, (n,), generator=gen))[0])
        uniques.append(per)
        buckets.append(bucketize(plan, names, per))
    recv_ids = simulated_alltoallv([b.send_ids for b in buckets], [b.send_splits for b in buckets])
    # Rank r's view of what everyone asks of it: row r of every rank's counts.
    recv_counts = [torch.stack([buckets[p].counts[r] for p in range(world)]) for r in range(world)]
    served, answers = [], []
    for r in range(world):
        local = split_ids(recv_ids[r], recv_counts[r])  # per table, [n_t]
        rows: list[torch.Tensor | None] = []
        for name, ids in zip(names, local, strict=True):
            start, stop = plan.table(name).rows_on(r)
            assert bool((ids < stop - start).all()), "an id was sent to a rank not owning it"
            rows.append(full[name][start:stop][ids] if stop > start else None)
        served.append(local)
        answers.append(pack_rows(rows, recv_counts[r]))
    back = simulated_alltoallv(answers, [float_splits(c, dims) for c in recv_counts])
    grads_out = []
    for r in range(world):
        assert back[r].numel() == sum(float_splits(buckets[r].counts, dims))
        for t, rows_t in enumerate(unpack_rows(back[r], buckets[r].counts, dims)):
            assert torch.equal(rows_t, full[names[t]][uniques[r][t]]), (r, names[t])
        grads_out.append(torch.full_like(back[r], r + 1.0))  # rank r's gradient: r + 1
    # Gradients back to the owners: each row gets the sum of (r + 1) over ranks asking.
    got = simulated_alltoallv(grads_out, [float_splits(b.counts, dims) for b in buckets])
    for t, name in enumerate(names):
        want = torch.zeros(cfgs[t].num_rows or 0)
        for r in range(world):
            want[uniques[r][t]] += r + 1
        have = torch.zeros_like(want)
        for r in range(world):
            g = unpack_rows(got[r], recv_counts[r], dims)[t]  # [n_t, D_t], columns equal
            start = plan.table(name).rows_on(r)[0]
            have.index_add_(0, served[r][t] + start, g[:, 0])
        assert torch.equal(have, want), name
