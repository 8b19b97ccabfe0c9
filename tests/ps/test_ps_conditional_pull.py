"""HET conditional pull: only rows whose store clock is more than ``bound`` past the caller's."""

from __future__ import annotations

import pytest
import torch

import ps

pytestmark = pytest.mark.timeout(60)

DIM = 3


def _store(dynamic: bool) -> ps.InProcessStore:
    store = ps.InProcessStore()
    store.create_table(
        ps.TableSpec(name="t", num_rows=None if dynamic else 50, dim=DIM, optimizer=ps.SGD(lr=0.1))
    )
    return store


@pytest.mark.parametrize("dynamic", [False, True], ids=["fixed", "dynamic"])
def test_returns_exactly_the_stale_rows(dynamic: bool) -> None:
    store = _store(dynamic)
    for k in range(4):  # row i has clock min(i, 4) for i in 0..9 after this
        ids = torch.arange(k + 1, 10)
        store.push("t", ids, torch.ones(ids.numel(), DIM))
    ids = torch.tensor([9, 0, 3, 3, 7, 2, 20])  # a repeat, and 20 has never been pushed
    full = store.pull("t", ids)
    assert full.positions is None
    assert full.clocks.tolist() == [4, 0, 3, 3, 4, 2, 0]
    caller = torch.tensor([1, 0, 1, 3, 4, 0, 0])
    for bound in (0, 1, 2, 5):
        got = store.pull("t", ids, clocks=caller, bound=bound)
        want = [i for i in range(7) if full.clocks[i] > caller[i] + bound]
        assert got.positions is not None and got.positions.tolist() == want
        assert got.positions.dtype == torch.int64
        assert torch.equal(got.rows, full.rows[want]) and got.rows.shape == (len(want), DIM)
        assert torch.equal(got.clocks, full.clocks[want])
    # bound 0 with 2 stale of 7, bound 1 with ..., counted in stats
    st = store.stats()["t"]
    assert st["pull_requests"] == 5
    sent = sum(len([i for i in range(7) if full.clocks[i] > caller[i] + b]) for b in (0, 1, 2, 5))
    assert st["rows_pulled"] == 7 + sent
    assert st["rows_skipped_by_bound"] == 4 * 7 - sent
    # Nothing stale: empty answer of the right shapes.
    none = store.pull("t", ids, clocks=full.clocks, bound=0)
    assert none.rows.shape == (0, DIM) and none.positions.tolist() == []  # type: ignore[union-attr]


def test_async_form_and_empty_request() -> None:
    store = _store(False)
    store.push("t", torch.tensor([1]), torch.ones(1, DIM))
    h = store.pull_async("t", torch.tensor([1, 2]), clocks=torch.tensor([0, 0]), bound=0)
    got = h.wait()
    assert got.positions.tolist() == [0] and got.clocks.tolist() == [1]
    empty = torch.empty(0, dtype=torch.int64)
    got = store.pull("t", empty, clocks=empty, bound=3)
    assert got.rows.shape == (0, DIM) and got.positions.tolist() == []


BAD = [
    (
        dict(clocks=torch.zeros(2, dtype=torch.int64)),
        ValueError,
        r"a conditional pull needs both clocks and bound",
    ),
    (
        dict(bound=1),
        ValueError,
        r"a conditional pull needs both clocks and bound, got clocks=None and bound=1",
    ),
    (
        dict(clocks=torch.zeros(2, dtype=torch.int64), bound=-1),
        ValueError,
        r"bound must be an int >= 0, got -1",
    ),
    (
        dict(clocks=torch.zeros(2, dtype=torch.int64), bound=True),
        ValueError,
        r"bound must be an int >= 0, got True",
    ),
    (
        dict(clocks=torch.zeros(2, dtype=torch.int64), bound=1.0),
        ValueError,
        r"bound must be an int >= 0, got 1.0",
    ),
    (dict(clocks=torch.zeros(2), bound=0), TypeError, r"clocks must be int64, got torch.float32"),
    (dict(clocks=[0, 0], bound=0), TypeError, r"clocks must be a torch.Tensor of int64, got list"),
    (
        dict(clocks=torch.zeros(3, dtype=torch.int64), bound=0),
        ValueError,
        r"clocks have shape \(3,\), expected \(2,\)",
    ),
]


@pytest.mark.parametrize("kwargs,exc,msg", BAD)
def test_bad_conditional_pull(kwargs, exc, msg) -> None:  # type: ignore[no-untyped-def]
    store = _store(True)
    store.push("t", torch.tensor([1]), torch.ones(1, DIM))
    before = store.stats()
    with pytest.raises(exc, match=r"pull table 't': " + msg):
        store.pull("t", torch.tensor([1, 2]), **kwargs)
    assert store.stats() == before  # rejected before anything was counted or touched
