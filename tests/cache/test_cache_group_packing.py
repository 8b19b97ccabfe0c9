"""A shared cache checks, packs and splits all its tables' ids at once
(``TableGroup.pack_many``; its group requests cut by ``ps.group_requests.split_pull``
and ``split_push``).

References: the same ids checked by ``ps.validate.check_ids`` and packed one table at a
time (``TableGroup.pack``), and per-table requests cut out of the packed ones by hand.
The packing runs a C kernel where one can be built and numpy otherwise: the tests of
``pack_many`` run both (``path``). Integer work only, so every comparison is exact.
"""

from __future__ import annotations

import pytest
import torch

import cache
import cache.table_group as table_group
import ps
from cache.kernels import pack_ids
from cache.table_group import TableGroup
from ps import PullRequest, PushRequest
from ps.group_requests import GroupPull, GroupPush, split_pull, split_push
from ps.validate import check_ids

pytestmark = pytest.mark.timeout(60)

PATHS = ["kernel", "numpy"]

DIM = 4
ROWS = {"a": 60, "b": 90, "c": 50}


def _specs(nan_policy: str = "raise") -> list[ps.TableSpec]:
    return [
        ps.TableSpec(name=n, num_rows=r, dim=DIM, optimizer=ps.SGD(lr=0.5), nan_policy=nan_policy)
        for n, r in ROWS.items()
    ]


def _store(specs: list[ps.TableSpec]) -> cache.CachedStore:
    inner = ps.InProcessStore()
    for spec in specs:
        inner.create_table(spec)
    return cache.CachedStore(inner, cache.CacheConfig(capacity_rows=8, group_tables=True))


def _use(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pack with the C kernel (skipped where none can be built) or force numpy's path."""
    if path == "numpy":
        monkeypatch.setattr(table_group, "pack_ids", lambda *a, **k: None)
    elif pack_ids._library() is None:
        pytest.skip("no C compiler: numpy path only")


def _one_by_one(group: TableGroup, parts: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    specs = {s.name: s for s in group.members}
    packed = [group.pack(t, check_ids(specs[t], i, "pull")) for t, i in parts]
    return torch.cat(packed) if packed else torch.empty(0, dtype=torch.int64)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("seed", range(6))
def test_pack_many_equals_packing_each_table(
    seed: int, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _use(path, monkeypatch)
    g = torch.Generator().manual_seed(seed)
    group = TableGroup.of(_specs())
    order = torch.randperm(3, generator=g).tolist()  # any member order, some parts empty
    parts = []
    for k in order:
        name, rows = list(ROWS.items())[k]
        n = int(torch.randint(0, 6, (1,), generator=g)) if seed % 2 else 5
        ids = torch.randint(0, rows, (2 * n,), generator=g)
        parts.append((name, ids[::2] if seed % 3 == 0 else ids[:n]))  # strided: not contiguous
    packed, sizes = group.pack_many(parts, "pull")
    assert sizes == [int(i.numel()) for _, i in parts]
    assert torch.equal(packed, _one_by_one(group, parts))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("op", ["pull", "prefetch", "push"])
@pytest.mark.parametrize("bad_at", [0, 1, 2])
@pytest.mark.parametrize("value", [-1, "rows", "lowest"])
def test_an_out_of_range_id_names_its_table_and_changes_nothing(
    op: str, bad_at: int, value: object, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _use(path, monkeypatch)
    store = _store(_specs())
    names = list(ROWS)
    ids = {n: torch.tensor([3, 1, 4]) for n in names}
    bad = names[bad_at]
    wrong = {-1: -1, "rows": ROWS[bad], "lowest": -(2**63)}[value]
    ids[bad] = torch.tensor([2, wrong, 0])
    with pytest.raises(ValueError) as want:
        check_ids(_specs()[bad_at], ids[bad], op)
    before = store.inner.pull_many([PullRequest(n, torch.arange(r)) for n, r in ROWS.items()])
    with pytest.raises(ValueError) as got:
        if op == "pull":
            store.pull_many([PullRequest(n, i) for n, i in ids.items()])
        elif op == "prefetch":
            store.prefetch_many([PullRequest(n, i) for n, i in ids.items()])
        else:
            grads = {n: torch.ones(int(i.numel()), DIM) for n, i in ids.items()}
            store.push_many([PushRequest(n, i, grads[n]) for n, i in ids.items()])
    assert str(got.value) == str(want.value)  # the table's own id and words, not the group's
    store.flush()
    after = store.inner.pull_many([PullRequest(n, torch.arange(r)) for n, r in ROWS.items()])
    for x, y in zip(before, after, strict=True):
        assert torch.equal(x.rows, y.rows) and torch.equal(x.clocks, y.clocks)
    assert all(s["updates"] == 0 and s["cached_rows"] == 0 for s in store.cache_stats().values())


def test_wrong_id_dtype_names_its_table() -> None:
    store = _store(_specs())
    with pytest.raises(TypeError, match=r"pull table 'b': ids must be int64, got torch.int32"):
        store.pull_many(
            [
                PullRequest("a", torch.tensor([1])),
                PullRequest("b", torch.tensor([1], dtype=torch.int32)),
            ]
        )


@pytest.mark.parametrize("seed", range(4))
def test_split_pull_and_push_cut_each_tables_run(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    group = TableGroup.of(_specs())
    parts = [(n, torch.randint(0, r, (7,), generator=g).unique()) for n, r in ROWS.items()]
    if seed % 2:
        parts[1] = ("b", torch.empty(0, dtype=torch.int64))  # a table without ids
    packed = _one_by_one(group, parts)  # sorted: tables in base order, ids sorted
    clocks = torch.randint(-3, 9, (int(packed.numel()),), generator=g)
    split = split_pull(GroupPull(group.space, packed, clocks, 2, True))
    start = 0
    want = []
    for name, ids in parts:
        if ids.numel():
            want.append((start, name, ids, clocks[start : start + ids.numel()]))
        start += int(ids.numel())
    assert len(split) == len(want)
    for (at, r), (w_at, name, ids, clk) in zip(split, want, strict=True):
        assert (at, r.table, r.bound, r.with_state) == (w_at, name, 2, True)
        assert torch.equal(r.ids, ids) and torch.equal(r.clocks, clk)
    # A push in any order comes back sorted by table, then id, repeats in their order.
    perm = torch.randperm(int(packed.numel()), generator=g)
    grads = torch.arange(int(packed.numel()) * DIM, dtype=torch.float32).reshape(-1, DIM)
    counts = torch.arange(int(packed.numel())) + 1
    pushes = split_push(GroupPush(group.space, packed[perm], grads[perm], counts[perm],
                                  grads[perm, :1]))  # fmt: skip
    assert [p.table for p in pushes] == [w[1] for w in want]
    for p, (at, _, ids, _) in zip(pushes, want, strict=True):
        rows = slice(at, at + int(ids.numel()))
        assert torch.equal(p.ids, ids) and torch.equal(p.grads, grads[rows])
        assert p.counts is not None and torch.equal(p.counts, counts[rows])
        assert p.stats is not None and torch.equal(p.stats, grads[rows, :1])


def test_a_skip_table_drops_its_rows_while_another_table_raises_naming_its_own_id() -> None:
    specs = _specs()
    specs[0] = ps.TableSpec(name="a", num_rows=60, dim=DIM, optimizer=ps.SGD(lr=0.5),
                            nan_policy="skip")  # fmt: skip
    store = _store(specs)
    nan = float("nan")
    a_ids, b_ids = torch.tensor([5, 7]), torch.tensor([11, 13])
    a_grads = torch.tensor([[nan] * DIM, [1.0] * DIM])
    b_grads = torch.tensor([[1.0] * DIM, [nan] * DIM])
    with pytest.raises(ValueError, match=r"push table 'b': gradient of row id 13 \(position 1\)"):
        store.push_many([PushRequest("a", a_ids, a_grads), PushRequest("b", b_ids, b_grads)])
    assert all(s["updates"] == 0 for s in store.cache_stats().values())
    # Without b's bad row: a's NaN row is dropped, its other row and b's rows applied.
    before = {n: store.inner.pull(n, i).rows for n, i in (("a", a_ids), ("b", b_ids))}
    ones = torch.ones(2, DIM)
    store.push_many([PushRequest("a", a_ids, a_grads), PushRequest("b", b_ids, ones)])
    store.flush()
    after = {n: store.inner.pull(n, i).rows for n, i in (("a", a_ids), ("b", b_ids))}
    assert torch.equal(after["a"][0], before["a"][0])  # the NaN row: dropped
    assert torch.equal(after["a"][1], before["a"][1] - 0.5)  # SGD, lr 0.5, gradient 1
    assert torch.equal(after["b"], before["b"] - 0.5)
