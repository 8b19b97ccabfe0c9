"""Group requests (``ps.group_requests``): every table of an id space pulled or pushed at
once by packed ids. The in-process store serves a lone group request whole in its C
pass; the base class (here through ``WrappedStore``, which has no batched calls of its
own) cuts it into one request per table.

References: each table's request cut out of the packed ids by hand and sent on its own
(``pull_async`` / ``push_many`` of one table), the replies joined by hand. Both sides run
the same row kernels in the same order on the same layout, so every comparison is bit
for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ps
from ps.group_requests import GroupPull, GroupPush, IdSpace
from tests.support.wrapped_store import WrappedStore

# numerics: the per-table reference goes through the table engine's own paths (a push of
# one table at a time included), which must keep the bits of the batched C pass on every
# instruction set ATen may pick.
pytestmark = [pytest.mark.timeout(60), pytest.mark.numerics]

DIM = 8
ROWS = {"a": 70, "b": 40, "c": 90}
BASES = np.array([0, 70, 110, 200], dtype=np.int64)


def _space() -> IdSpace:
    return IdSpace(tuple(ROWS), BASES)


def _stores(dtype: str = "fp32") -> tuple[ps.Store, ...]:
    """Three stores of the same tables with the same history (so clocks differ by row):
    the in-process store, a second one, and the base class's path over a third."""
    out = []
    for _ in range(3):
        store = ps.InProcessStore()
        for name, rows in ROWS.items():
            opt = ps.RowWiseAdagrad(lr=0.1)
            store.create_table(ps.TableSpec(name=name, num_rows=rows, dim=DIM, optimizer=opt,
                                            dtype=dtype))  # fmt: skip
            g = torch.Generator().manual_seed(len(name) + rows)
            for _ in range(3):
                ids = torch.randint(0, rows, (rows // 2,), generator=g).unique()
                store.push(name, ids, torch.randn(ids.numel(), DIM, generator=g))
        out.append(store)
    return out[0], out[1], WrappedStore(out[2])


def _packed(seed: int, *, skip: str | None = None) -> torch.Tensor:
    """Sorted distinct packed ids of every table (none of ``skip``)."""
    g = torch.Generator().manual_seed(seed)
    parts = []
    for i, (name, rows) in enumerate(ROWS.items()):
        if name != skip:
            parts.append(torch.randint(0, rows, (rows // 3,), generator=g).unique() + BASES[i])
    return torch.cat(parts)


def _by_hand_pull(store: ps.Store, r: GroupPull) -> ps.PullResult:
    """Each table's ids cut out of the packed ones and pulled alone; replies joined."""
    rows, clocks, positions, states = [], [], [], []
    packed = r.ids
    for i, name in enumerate(ROWS):
        mine = torch.nonzero((packed >= BASES[i]) & (packed < BASES[i + 1])).flatten()
        if mine.numel() == 0:
            continue
        ids = packed[mine] - int(BASES[i])
        clk = None if r.clocks is None else r.clocks[mine]
        got = store.pull_async(name, ids, clocks=clk, bound=r.bound).wait()
        rows.append(got.rows)
        clocks.append(got.clocks)
        back = mine if got.positions is None else mine[got.positions]
        positions.append(back)
        if r.with_state:
            states.append(store.state(name, ids if got.positions is None else ids[got.positions]))
    pos = torch.cat(positions) if r.bound is not None else None
    return ps.PullResult(torch.cat(rows), torch.cat(clocks), pos,
                         torch.cat(states) if r.with_state else None)  # fmt: skip


def _same(a: ps.PullResult, b: ps.PullResult) -> None:
    assert torch.equal(a.rows, b.rows)
    assert torch.equal(a.clocks, b.clocks)
    assert (a.positions is None) == (b.positions is None)
    if a.positions is not None and b.positions is not None:
        assert torch.equal(a.positions, b.positions)
    assert (a.state is None) == (b.state is None)
    if a.state is not None and b.state is not None:
        assert torch.equal(a.state, b.state)


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("bound", [None, 0, 1])
@pytest.mark.parametrize("seed", range(2))
def test_a_group_pull_equals_its_tables_pulled_one_by_one(
    seed: int, bound: int | None, with_state: bool, dtype: str
) -> None:
    whole, _, cut = _stores(dtype)
    packed = _packed(seed, skip="b" if seed else None)
    clocks = None
    if bound is not None:  # callers' clocks around the tables' (0 .. 3): some rows come back
        g = torch.Generator().manual_seed(seed)
        clocks = torch.randint(-2, 4, (packed.numel(),), generator=g)
    r = GroupPull(_space(), packed, clocks, bound, with_state)
    served = whole._batched.served  # type: ignore[attr-defined]
    before = whole.request_counts()["pull_messages"]
    (got,) = whole.pull_groups_async([r]).wait()
    assert whole._batched.served == served + 1  # type: ignore[attr-defined]  # whole, in C
    assert whole.request_counts()["pull_messages"] == before + 1
    want = _by_hand_pull(cut, r)
    _same(got, want)
    (got_cut,) = cut.pull_groups_async([r]).wait()
    _same(got_cut, want)


def test_an_empty_group_pull_and_a_mixed_batch() -> None:
    whole, _, cut = _stores()
    empty = GroupPull(_space(), torch.empty(0, dtype=torch.int64))
    for store in (whole, cut):
        (got,) = store.pull_groups_async([empty]).wait()
        assert got.rows.shape == (0, DIM) and got.clocks.numel() == 0
    # A group request beside a plain one: one result each, in order.
    packed = _packed(3)
    plain = ps.PullRequest("b", torch.tensor([5, 1, 5]))
    for store in (whole, cut):
        grouped, alone = store.pull_groups_async([GroupPull(_space(), packed), plain]).wait()
        _same(grouped, _by_hand_pull(cut, GroupPull(_space(), packed)))
        _same(alone, cut.pull("b", torch.tensor([5, 1, 5])))


@pytest.mark.parametrize("counted", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_a_group_push_equals_its_tables_pushed_one_by_one(seed: int, counted: bool) -> None:
    whole, by_hand, cut = _stores()
    g = torch.Generator().manual_seed(seed)
    packed = _packed(seed + 10)
    n = packed.numel()
    order = torch.randperm(n, generator=g)  # any order: the group push sorts it
    grads = torch.randn(n, DIM, generator=g)
    counts = stats = None
    if counted:
        counts = torch.randint(1, 4, (n,), generator=g)
        stats = (grads * grads).mean(dim=1, keepdim=True) * counts.unsqueeze(1)
    served = whole._batched.served  # type: ignore[attr-defined]
    shuffled = GroupPush(
        _space(),
        packed[order],
        grads[order],
        None if counts is None else counts[order],
        None if stats is None else stats[order],
    )
    whole.push_groups_async([shuffled]).wait()
    assert whole._batched.served == served + 1  # type: ignore[attr-defined]
    checked = [whole]
    if not counted:  # (the base class takes no counted pushes: its push_async cannot carry them)
        cut.push_groups_async([GroupPush(_space(), packed, grads)]).wait()
        checked.append(cut)
    reqs = []
    for i, name in enumerate(ROWS):
        mine = torch.nonzero((packed >= BASES[i]) & (packed < BASES[i + 1])).flatten()
        reqs.append(ps.PushRequest(name, packed[mine] - int(BASES[i]), grads[mine],
                                   None if counts is None else counts[mine],
                                   None if stats is None else stats[mine]))  # fmt: skip
    by_hand.push_many(reqs)
    for name, rows in ROWS.items():
        every = torch.arange(rows)
        want = by_hand.pull(name, every)
        for store in checked:
            _same(store.pull(name, every), want)
            assert torch.equal(store.state(name, every), by_hand.state(name, every))


def test_a_group_push_with_repeated_ids_sums_them_as_its_tables_would() -> None:
    whole, by_hand, _ = _stores()
    packed = torch.tensor([3, 3, 75, 150, 75])  # a: 3 twice; b: 5 twice; c: 40
    grads = torch.arange(5 * DIM, dtype=torch.float32).reshape(5, DIM) / 10
    whole.push_groups_async([GroupPush(_space(), packed, grads)]).wait()
    by_hand.push_many([
        ps.PushRequest("a", torch.tensor([3, 3]), grads[[0, 1]]),
        ps.PushRequest("b", torch.tensor([5, 5]), grads[[2, 4]]),
        ps.PushRequest("c", torch.tensor([40]), grads[[3]]),
    ])  # fmt: skip
    for name, rows in ROWS.items():
        every = torch.arange(rows)
        _same(whole.pull(name, every), by_hand.pull(name, every))


def test_bad_group_requests_raise_naming_what_is_wrong_and_change_nothing() -> None:
    whole, _, cut = _stores()
    before = {n: whole.pull(n, torch.arange(r)) for n, r in ROWS.items()}
    space = _space()
    for store in (whole, cut):
        with pytest.raises(ValueError, match="a\\+b\\+c: ids must be sorted"):
            store.pull_groups_async([GroupPull(space, torch.tensor([80, 3]))])
        with pytest.raises(ValueError, match="packed id 200 is outside \\[0, 200\\)"):
            store.pull_groups_async([GroupPull(space, torch.tensor([3, 200]))])
        with pytest.raises(ValueError, match="packed id -1 is outside"):
            store.push_groups_async([GroupPush(space, torch.tensor([-1, 4]), torch.ones(2, DIM))])
        nan = torch.ones(2, DIM)
        nan[1, 2] = float("nan")
        with pytest.raises(ValueError, match="push table 'c'.*row id 20"):
            store.push_groups_async([GroupPush(space, torch.tensor([4, 130]), nan)])
        unknown = IdSpace(("a", "nope"), np.array([0, 70, 100], dtype=np.int64))
        with pytest.raises(ValueError, match="unknown table 'nope'"):
            store.pull_groups_async([GroupPull(unknown, torch.tensor([1, 80]))])
    for n, r in ROWS.items():
        _same(whole.pull(n, torch.arange(r)), before[n])
    with pytest.raises(TypeError, match="ids must be torch.int64, got torch.int32"):
        GroupPull(space, torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="clocks must have shape \\[2\\], got \\[3\\]"):
        GroupPull(space, torch.tensor([1, 2]), torch.zeros(3, dtype=torch.int64), 1)
    with pytest.raises(ValueError, match="grads must have shape \\[2, \\*\\], got \\[3, 8\\]"):
        GroupPush(space, torch.tensor([1, 2]), torch.ones(3, DIM))
    with pytest.raises(TypeError, match="expected a ps.PullRequest or ps.GroupPull"):
        whole.pull_groups_async([object()])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="bases must rise from 0"):
        IdSpace(("a", "b"), np.array([0, 70, 60], dtype=np.int64))
