"""Dynamic tables (num_rows=None): creation on first push, the id index, LRU and age eviction."""

from __future__ import annotations

import pytest
import torch

import ps
from ps.local.dynamic_index import IdIndex

pytestmark = pytest.mark.timeout(60)

DIM = 4


def _dyn(name: str = "d", **kw: object) -> tuple[ps.InProcessStore, ps.TableSpec]:
    opt = kw.pop("optimizer", ps.RowWiseAdagrad(lr=0.1))
    spec = ps.TableSpec(name=name, num_rows=None, dim=DIM, optimizer=opt, **kw)  # type: ignore[arg-type]
    store = ps.InProcessStore()
    store.create_table(spec)
    return store, spec


def _exists(store: ps.Store, ids: list[int]) -> list[bool]:
    # Every row here was pushed at least once, so a clock of 0 means "no row".
    return [c > 0 for c in store.clocks("d", torch.tensor(ids)).tolist()]


def test_same_rows_in_independent_stores_and_pull_creates_nothing() -> None:
    ids = torch.tensor([-(2**63), -1, 0, 7, 2**40 + 3, 2**63 - 1, 7])
    a, spec = _dyn()
    b, _ = _dyn()
    got_a = a.pull("d", ids)
    got_b = b.pull("d", ids.flip(0))  # other order, other store
    assert torch.equal(got_a.rows, got_b.rows.flip(0))
    assert torch.equal(got_a.rows, spec.initial_rows(ids))
    assert got_a.clocks.tolist() == [0] * 7
    assert torch.equal(got_a.rows[3], got_a.rows[6])  # the same id twice
    assert a.stats()["d"]["rows"] == 0 and a.stats()["d"]["rows_created"] == 0
    # A push creates rows from the same initial values, in any store, in any batch split.
    g = torch.randn(ids.numel(), DIM)
    a.push("d", ids, g)
    b.push("d", ids[:3], g[:3])
    b.push("d", ids[3:], g[3:])  # id 7 twice in this second push: summed
    assert torch.equal(a.pull("d", ids).rows, b.pull("d", ids).rows)
    assert a.stats()["d"]["rows"] == 6 and a.stats()["d"]["rows_created"] == 6
    assert a.clocks("d", ids).tolist() == [1] * 7


def test_lru_capacity_eviction_is_deterministic_and_counted() -> None:
    store, spec = _dyn(capacity=4)
    store.push("d", torch.tensor([10, 11, 12]), torch.ones(3, DIM))  # step 1
    store.push("d", torch.tensor([13]), torch.ones(1, DIM))  # step 2: 4 rows, at capacity
    store.pull("d", torch.tensor([10]))  # touches 10 at step 2: now newer than 11, 12
    store.push("d", torch.tensor([14, 15]), torch.ones(2, DIM))  # step 3: 6 rows -> evict 2
    # Least recently touched first: 11 and 12 (step 1); 10 was pulled at step 2.
    assert _exists(store, [10, 11, 12, 13, 14, 15]) == [True, False, False, True, True, True]
    st = store.stats()["d"]
    assert st["rows"] == 4 and st["rows_evicted"] == 2 and st["rows_created"] == 6
    # Ties in the touch step go by smaller id first.
    store.push("d", torch.tensor([30, 20, 40]), torch.ones(3, DIM))  # step 4: 7 rows -> evict 3
    assert _exists(store, [10, 13, 14, 15]) == [False, False, False, True]  # step 2, 2, 3
    store.push("d", torch.tensor([60, 50]), torch.ones(2, DIM))  # step 5: 6 rows -> evict 2
    assert _exists(store, [15, 20, 30, 40, 50, 60]) == [False, False, True, True, True, True]
    assert store.stats()["d"]["rows_evicted"] == 7


def test_age_eviction_counts_pushes_and_pulls_refresh() -> None:
    store, _ = _dyn(max_age_steps=2)
    one = torch.ones(1, DIM)
    store.push("d", torch.tensor([1]), one)  # step 1
    store.push("d", torch.tensor([2]), one)  # step 2: row 1 untouched for 1 push
    assert _exists(store, [1, 2]) == [True, True]
    store.pull("d", torch.tensor([1]))  # a pull is a touch (at step 2)
    store.push("d", torch.tensor([3]), one)  # step 3
    assert _exists(store, [1, 2, 3]) == [True, True, True]
    store.push("d", torch.empty(0, dtype=torch.int64), torch.empty(0, DIM))  # step 4
    # Row 1 (touched at 2) and row 2 (at 2) have gone 2 pushes untouched; row 3 only 1.
    assert _exists(store, [1, 2, 3]) == [False, False, True]
    assert store.stats()["d"]["rows_evicted"] == 2


def test_evicted_row_restarts_from_init() -> None:
    opt = ps.Adam(lr=0.1)
    store, spec = _dyn(capacity=1, optimizer=opt)
    fresh, _ = _dyn(optimizer=opt)
    g1, g2 = torch.randn(1, DIM), torch.randn(1, DIM)
    store.push("d", torch.tensor([5]), g1)
    store.push("d", torch.tensor([6]), g1)  # evicts 5
    assert store.clocks("d", torch.tensor([5])).tolist() == [0]
    assert torch.equal(
        store.pull("d", torch.tensor([5])).rows, spec.initial_rows(torch.tensor([5]))
    )
    assert torch.equal(store.state("d", torch.tensor([5])), torch.zeros(1, 2 * DIM + 1))
    store.push("d", torch.tensor([5]), g2)  # re-created: weights, Adam moments and step fresh
    fresh.push("d", torch.tensor([5]), g2)
    assert torch.equal(
        store.pull("d", torch.tensor([5])).rows, fresh.pull("d", torch.tensor([5])).rows
    )
    assert torch.equal(store.state("d", torch.tensor([5])), fresh.state("d", torch.tensor([5])))
    assert store.clocks("d", torch.tensor([5])).tolist() == [1]


def test_many_ids_through_index_and_slot_reuse() -> None:
    # 60k rows with churn: creation, eviction (slots reused), re-creation; every live row
    # must still read back its own values (compared with a store that never evicts).
    gen = torch.Generator().manual_seed(0)
    store, _ = _dyn(capacity=20_000, optimizer=ps.SGD(lr=1.0))
    ref, _ = _dyn(optimizer=ps.SGD(lr=1.0))
    live: set[int] = set()
    for _ in range(6):
        ids = torch.unique(torch.randint(-(10**12), 10**12, (12_000,), generator=gen))
        ids = ids[torch.randperm(ids.numel(), generator=gen)]
        g = torch.randn(ids.numel(), DIM, generator=gen)
        store.push("d", ids, g)
        ref.push("d", ids, g)
        live |= set(ids.tolist())
    assert store.stats()["d"]["rows"] == 20_000
    assert ref.stats()["d"]["rows"] == len(live)
    last = ids  # the newest rows survive eviction and match the never-evicting store
    assert torch.equal(store.pull("d", last).rows, ref.pull("d", last).rows)
    assert torch.equal(store.clocks("d", last), ref.clocks("d", last))


def test_id_index_against_dict() -> None:
    gen = torch.Generator().manual_seed(1)
    index = IdIndex()
    want: dict[int, int] = {}
    next_val = 0
    for step in range(40):
        cand = torch.randint(-5000, 5000, (300,), generator=gen) * (2**50 + 1)
        cand = torch.unique(cand)
        new = torch.tensor([i for i in cand.tolist() if i not in want], dtype=torch.int64)
        vals = torch.arange(next_val, next_val + new.numel())
        next_val += new.numel()
        index.insert(new, vals)
        want.update(zip(new.tolist(), vals.tolist(), strict=True))
        if step % 3 == 2:  # delete a third of the keys: tombstones, then rebuilds
            keys = list(want)[::3]
            old = index.remove(torch.tensor(keys, dtype=torch.int64))
            assert old.tolist() == [want.pop(k) for k in keys]
        probe = torch.cat([cand, torch.tensor([123, -(2**63), 2**63 - 1])])
        got = index.lookup(probe).tolist()
        assert got == [want.get(i, -1) for i in probe.tolist()]
        assert len(index) == len(want)
    ids, vals = index.items()
    assert dict(zip(ids.tolist(), vals.tolist(), strict=True)) == want
    assert index.capacity >= 2 * len(want)


def test_dynamic_spec_validation() -> None:
    with pytest.raises(ValueError, match=r"table 'f': capacity=5 needs a dynamic table"):
        ps.TableSpec(name="f", num_rows=10, dim=2, optimizer=ps.SGD(lr=1.0), capacity=5)
    with pytest.raises(ValueError, match=r"table 'f': max_age_steps must be None or an int > 0"):
        ps.TableSpec(name="f", num_rows=None, dim=2, optimizer=ps.SGD(lr=1.0), max_age_steps=0)
    with pytest.raises(ValueError, match=r"table 'f': nan_policy must be one of"):
        ps.TableSpec(name="f", num_rows=None, dim=2, optimizer=ps.SGD(lr=1.0), nan_policy="zero")  # type: ignore[arg-type]
    spec = ps.TableSpec(name="f", num_rows=None, dim=2, optimizer=ps.SGD(lr=1.0))
    assert spec.dynamic and spec.init == ps.UniformInit(low=-0.01, high=0.01, seed=spec.init.seed)  # type: ignore[union-attr]
