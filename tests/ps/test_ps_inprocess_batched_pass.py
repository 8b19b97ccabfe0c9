"""The in-process store's batched requests in one C pass (``ps.local.batched_pass``).

The reference is a second in-process store taking the same work one table at a time
(``pull`` / ``push``: the table engine's Python path, which the pass must equal). Both
run the same row step (``rowwise_adagrad.c``) on the same rows in the same order, and a
pull copies rows, so rows, state, clocks, positions and counters are compared bit for
bit. Requests the pass does not take (dynamic tables, other optimizers, bad input) go
the Python path: the same results, and the same errors with nothing changed.
"""

from __future__ import annotations

import threading

import pytest
import torch

import ps
from ps import PullRequest, PushRequest
from ps.kernels import message_pass
from tolerance import assert_same

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not message_pass.available(), reason="no C compiler: no pass"),
]

SAME = "the pass and the part-by-part path run the same row step on the same rows"
SPECS = [
    ps.TableSpec(name="a", num_rows=300, dim=4, optimizer=ps.RowWiseAdagrad(lr=0.1)),
    ps.TableSpec(name="b", num_rows=500, dim=16, optimizer=ps.RowWiseAdagrad(lr=0.05)),
    ps.TableSpec(name="c", num_rows=200, dim=8, optimizer=ps.RowWiseAdagrad(lr=0.2, eps=1e-6)),
]


def _stores(specs: list[ps.TableSpec]) -> tuple[ps.InProcessStore, ps.InProcessStore]:
    mine, ref = ps.InProcessStore(), ps.InProcessStore()
    for spec in specs:
        mine.create_table(spec)
        ref.create_table(spec)
    return mine, ref


def _same(mine: ps.InProcessStore, ref: ps.InProcessStore, specs: list[ps.TableSpec]) -> None:
    for spec in specs:
        ids = torch.arange(spec.num_rows or 0)
        what = f"table {spec.name}"
        assert_same(
            mine.pull(spec.name, ids).rows, ref.pull(spec.name, ids).rows, what=what, why=SAME
        )
        assert_same(mine.state(spec.name, ids), ref.state(spec.name, ids), what=what, why=SAME)
        assert torch.equal(mine.clocks(spec.name, ids), ref.clocks(spec.name, ids)), what


def _counters(store: ps.InProcessStore) -> dict[str, dict[str, int | float]]:
    return store.stats()


def _result_equal(a: ps.PullResult, b: ps.PullResult, what: str) -> None:
    assert_same(a.rows, b.rows, what=what, why=SAME)
    assert a.rows.is_contiguous() and a.rows.dtype == torch.float32, what
    assert torch.equal(a.clocks, b.clocks), what
    assert (a.positions is None) == (b.positions is None), what
    if a.positions is not None and b.positions is not None:
        assert torch.equal(a.positions, b.positions), what
    assert (a.state is None) == (b.state is None), what
    if a.state is not None and b.state is not None:
        assert_same(a.state, b.state, what=f"{what} state", why=SAME)


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """torch's intra-op threads, which the pass serves the parts of different tables on."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("counted", [False, True])
def test_batched_requests_equal_part_by_part(counted: bool, threads: int) -> None:
    """Plain, conditional and with-state pulls; pushes with repeated, unsorted ids (counted:
    counts up to 5 and their statistics): rows, state, clocks and counters bit for bit,
    and every batch served by the pass, on one thread or one per table part."""
    mine, ref = _stores(SPECS)
    gen = torch.Generator().manual_seed(3)
    served = 0
    for step in range(8):
        pulls = []
        for k, spec in enumerate(SPECS):
            ids = torch.randint(0, spec.num_rows or 0, (40 + 9 * k,), generator=gen)
            if (step + k) % 2:
                clocks = ref.clocks(spec.name, ids) - torch.randint(0, 3, ids.shape, generator=gen)
                pulls.append(PullRequest(spec.name, ids, clocks, step % 3, step % 2 == 1))
            else:
                pulls.append(PullRequest(spec.name, ids, with_state=step % 2 == 1))
        got = mine.pull_many(pulls)
        for r, g in zip(pulls, got, strict=True):
            want = ref.pull(r.table, r.ids, clocks=r.clocks, bound=r.bound)
            if r.with_state:
                back = r.ids if want.positions is None else r.ids[want.positions]
                want = ps.PullResult(
                    want.rows, want.clocks, want.positions, ref.state(r.table, back)
                )
            _result_equal(g, want, f"step {step} pull {r.table}")
        pushes = []
        for k, spec in enumerate(SPECS):
            n = 30 + 5 * k
            ids = torch.randint(0, spec.num_rows or 0, (n,), generator=gen)  # repeats, unsorted
            grads = torch.randn(n, spec.dim, generator=gen)
            if counted:
                counts = torch.randint(1, 6, (n,), generator=gen)
                stats = grads.square().mean(dim=1, keepdim=True) * counts.unsqueeze(1)
                pushes.append(PushRequest(spec.name, ids, grads, counts, stats))
            else:
                pushes.append(PushRequest(spec.name, ids, grads))
        mine.push_many(pushes)
        for r in pushes:
            ref.push_many([r])  # one table at a time: the part-by-part path
        served += 2
        _same(mine, ref, SPECS)
        assert mine._batched.served == served, "the pass served both batches"
    assert _counters(mine) == _counters(ref)


def test_tables_the_pass_does_not_take_go_the_python_path() -> None:
    """Adam and a dynamic table beside a row-wise Adagrad one: the same results as one table
    at a time, served part by part (pulls of fixed tables still in the pass)."""
    specs = [
        SPECS[0],
        ps.TableSpec(name="adam", num_rows=100, dim=4, optimizer=ps.Adam(lr=0.01)),
        ps.TableSpec(name="dyn", num_rows=None, dim=4, optimizer=ps.RowWiseAdagrad(lr=0.1)),
    ]
    mine, ref = _stores(specs)
    gen = torch.Generator().manual_seed(5)
    for step in range(4):
        ids = [torch.randint(0, 100, (25,), generator=gen) for _ in specs]
        grads = [torch.randn(25, 4, generator=gen) for _ in specs]
        mine.push_many(
            [PushRequest(s.name, i, g) for s, i, g in zip(specs, ids, grads, strict=True)]
        )
        for s, i, g in zip(specs, ids, grads, strict=True):
            ref.push(s.name, i, g)
        fixed = [PullRequest(s.name, i) for s, i in zip(specs[:2], ids[:2], strict=True)]
        for r, g in zip(fixed, mine.pull_many(fixed), strict=True):
            _result_equal(g, ref.pull(r.table, r.ids), f"step {step} {r.table}")
    _same(mine, ref, specs[:2])
    every = torch.arange(100)
    assert_same(mine.pull("dyn", every).rows, ref.pull("dyn", every).rows, what="dyn", why=SAME)
    assert mine._batched.served == 4, "only the pulls of fixed tables"
    assert _counters(mine) == _counters(ref)


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ("id", r"push table 'c': id 200 at position 3 is out of range; valid ids are \[0, 200\)"),
        ("nan", r"push table 'c': gradient of row id .* contains NaN"),
        ("count", r"push table 'c': count 0 for row id"),
        ("dtype", r"push table 'c': ids must be int64"),
        ("summed_count", r"push table 'c': count 0 for row id 7"),
        ("summed_stat", r"push table 'c': stats must be finite and >= 0"),
    ],
)
def test_a_bad_part_raises_the_python_error_and_changes_nothing(bad: str, match: str) -> None:
    mine, ref = _stores(SPECS)
    gen = torch.Generator().manual_seed(9)
    pushes = []
    for spec in SPECS:
        ids = torch.randint(0, spec.num_rows or 0, (10,), generator=gen)
        grads = torch.randn(10, spec.dim, generator=gen)
        counts = torch.ones(10, dtype=torch.int64)
        stats = grads.square().mean(dim=1, keepdim=True)
        pushes.append(PushRequest(spec.name, ids, grads, counts, stats))
    last = pushes[-1]
    if bad == "id":
        ids = last.ids.clone()
        ids[3] = 200
        pushes[-1] = PushRequest("c", ids, last.grads, last.counts, last.stats)
    elif bad == "nan":
        grads = last.grads.clone()
        grads[4, 1] = float("nan")
        pushes[-1] = PushRequest("c", last.ids, grads, last.counts, last.stats)
    elif bad == "count":
        counts = last.counts.clone()
        counts[2] = 0
        pushes[-1] = PushRequest("c", last.ids, last.grads, counts, last.stats)
    elif bad == "dtype":
        pushes[-1] = PushRequest("c", last.ids.int(), last.grads, last.counts, last.stats)
    else:  # a repeated id whose bad count or statistic would sum to a good one
        ids = last.ids.clone()
        ids[:2] = 7
        counts, stats = last.counts.clone(), last.stats.clone()
        if bad == "summed_count":
            counts[:2] = torch.tensor([0, 2])
        else:
            stats[:2, 0] = torch.tensor([-1.0, 2.0])
        pushes[-1] = PushRequest("c", ids, last.grads, counts, stats)
    with pytest.raises((ValueError, TypeError), match=match):
        mine.push_many(pushes)
    _same(mine, ref, SPECS)
    with pytest.raises(ValueError, match=r"pull table 'b': id -1 at position 0 is out of range"):
        mine.pull_many([PullRequest("a", torch.arange(3)), PullRequest("b", torch.tensor([-1]))])
    with pytest.raises(ValueError, match=r"unknown table 'zz'"):
        mine.pull_many([PullRequest("a", torch.arange(3)), PullRequest("zz", torch.arange(3))])
    assert _counters(mine) == _counters(ref), "a refused request counts nothing"


@pytest.mark.parametrize("bad", ["none", "count", "stat", "inf_stat", "nan"])
def test_sorted_distinct_parts_skip_the_sums_and_the_pass_checks_them(bad: str) -> None:
    """A cache's push: every part's ids sorted and distinct, so nothing is summed in
    Python and the pass's own check covers counts, statistics and gradients: a good
    batch equals part by part, a bad value in any part raises the Python path's error
    with nothing changed."""
    mine, ref = _stores(SPECS)
    gen = torch.Generator().manual_seed(5)
    pushes = []
    for spec in SPECS:
        ids = torch.randperm(spec.num_rows or 0, generator=gen)[:12].sort().values
        grads = torch.randn(12, spec.dim, generator=gen)
        counts = torch.randint(1, 4, (12,), generator=gen)
        stats = grads.square().mean(dim=1, keepdim=True) * counts.unsqueeze(1)
        pushes.append(PushRequest(spec.name, ids, grads, counts, stats))
    last = pushes[1]
    counts, stats, grads = last.counts.clone(), last.stats.clone(), last.grads.clone()
    if bad == "count":
        counts[5] = 0
    elif bad == "stat":
        stats[5, 0] = -0.5
    elif bad == "inf_stat":
        stats[5, 0] = float("inf")
    elif bad == "nan":
        grads[5, 2] = float("nan")
    pushes[1] = PushRequest("b", last.ids, grads, counts, stats)
    if bad == "none":
        mine.push_many(pushes)
        for r in pushes:
            ref.push_many([r])
        assert mine._batched.served == 1, "the pass served the batch"
    else:
        with pytest.raises(ValueError, match=r"push table 'b'"):
            mine.push_many(pushes)
        assert mine._batched.served == 0, "nothing was applied by the pass"
    _same(mine, ref, SPECS)
    assert _counters(mine) == _counters(ref)


def test_tables_replaced_by_a_load_or_a_create_are_served_from_their_new_rows(tmp_path) -> None:
    mine, _ = _stores(SPECS[:1])
    ids = torch.arange(20)
    mine.push_many([PushRequest("a", ids, torch.ones(20, 4))])
    mine.save(tmp_path / "ck")
    saved = mine.pull_many([PullRequest("a", ids)])[0].rows.clone()
    mine.push_many([PushRequest("a", ids, torch.ones(20, 4))])
    mine.load(tmp_path / "ck")
    assert_same(mine.pull_many([PullRequest("a", ids)])[0].rows, saved, what="loaded", why=SAME)
    mine.drop_table("a")
    mine.create_table(SPECS[0])
    fresh = ps.InProcessStore()
    fresh.create_table(SPECS[0])
    mine.push_many([PushRequest("a", ids, torch.ones(20, 4))])
    fresh.push("a", ids, torch.ones(20, 4))
    _same(mine, fresh, SPECS[:1])


def test_threads_batching_overlapping_tables_do_not_deadlock() -> None:
    """Batches naming the tables in different orders, from three threads at once, with
    single-table requests between them: every push applied once (clocks count them)."""
    store = ps.InProcessStore()
    for spec in SPECS:
        store.create_table(spec)
    ids = torch.arange(100)
    rounds = 60
    orders = [SPECS, SPECS[::-1], [SPECS[1], SPECS[0], SPECS[2]]]

    def work(order: list[ps.TableSpec]) -> None:
        for _ in range(rounds):
            store.push_many([PushRequest(s.name, ids, torch.ones(100, s.dim)) for s in order])
            store.pull_many([PullRequest(s.name, ids) for s in order])
            store.push(order[0].name, ids[:1], torch.ones(1, order[0].dim))

    threads = [threading.Thread(target=work, args=(o,)) for o in orders]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=45)
        assert not t.is_alive(), "a batched request deadlocked"
    singles = {s.name: sum(o[0].name == s.name for o in orders) for s in SPECS}
    for s in SPECS:
        clocks = store.clocks(s.name, ids)
        assert int(clocks[1]) == 3 * rounds
        assert int(clocks[0]) == 3 * rounds + singles[s.name] * rounds


def test_empty_parts_and_parts_that_join_without_a_copy() -> None:
    """An empty part beside full ones comes back ``[0, D]``; the parts' rows lie back to back
    in one buffer, so joining them (as the hybrid tables do) reads the same rows."""
    mine, ref = _stores(SPECS[:2])
    ids = torch.tensor([5, 1, 5])
    got = mine.pull_many(
        [PullRequest("a", ids[:0]), PullRequest("a", ids), PullRequest("b", ids[:0])]
    )
    assert [tuple(g.rows.shape) for g in got] == [(0, 4), (3, 4), (0, 16)]
    assert [tuple(g.clocks.shape) for g in got] == [(0,), (3,), (0,)]
    _result_equal(got[1], ref.pull("a", ids), "the full part")
    joined = torch.as_strided(got[0].rows, (3, 4), (4, 1), got[0].rows.storage_offset())
    assert_same(joined, got[1].rows, what="rows after an empty part", why=SAME)


def test_gradients_back_to_back_in_one_buffer_equal_part_by_part(threads: int) -> None:
    """Sorted, distinct parts whose gradients are slices of one buffer (as the hybrid
    tables push them: one [U, D] per dim group) are read in place, tables of different
    widths included: the same rows and state as the part-by-part path."""
    mine, ref = _stores(SPECS)
    gen = torch.Generator().manual_seed(11)
    for step in range(4):
        parts = []
        for spec in SPECS:
            n = 20 + 7 * step
            ids = torch.randperm(spec.num_rows or 0, generator=gen)[:n].sort().values
            parts.append((spec, ids))
        sizes = [ids.numel() * spec.dim for spec, ids in parts]
        buf = torch.randn(sum(sizes), generator=gen)  # every table's gradients, back to back
        pushes, at = [], 0
        for (spec, ids), size in zip(parts, sizes, strict=True):
            grads = buf[at : at + size].view(ids.numel(), spec.dim)
            pushes.append(PushRequest(spec.name, ids, grads))
            at += size
        mine.push_many(pushes)
        for r in pushes:
            ref.push_many([r])
        _same(mine, ref, SPECS)
    assert mine._batched.served == 4
