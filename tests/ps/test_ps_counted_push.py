"""Counted pushes (``ps.PushRequest`` ``counts``, ``stats``): one push that stands for
``k`` updates of a row, against ``k`` one-by-one pushes of the same gradients.

The reference is the same store taking the ``k`` gradients of each row one push at a
time. With equal gradients, exactly representable, and ``k`` a power of two, the mean
gradient ``G / k`` and the mean square ``S / k`` are the gradient and its square bit
for bit, so each sub-step runs the operations of one plain push: the rows and the
state are the reference's bits (dynamic tables: both sides run the torch update; on a
fixed row-wise Adagrad table the reference runs the C kernel, whose mean of squares
and multiply-adds round differently, so there the tolerance is a few ulps per step).
Adam's second moment takes ``(1 - b2) * (g * g)`` where one push takes
``((1 - b2) * g) * g``: one rounding apart per sub-step (tolerance below). With unequal
gradients the accumulators still grow by exactly the sum of the squares (up to the
order of the additions), Adam's step count by ``k``, and the row's clock by one.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ps
from tolerance import assert_close, assert_same, sum_tol

pytestmark = [pytest.mark.timeout(60), pytest.mark.numerics]

DIM = 8
OPTIMIZERS = {
    "sgd": ps.SGD(lr=0.1),
    "sgd_momentum": ps.SGD(lr=0.1, momentum=0.9),
    "rowwise_adagrad": ps.RowWiseAdagrad(lr=0.1),
    "adagrad": ps.Adagrad(lr=0.1),
    "adam": ps.Adam(lr=0.01),
    "adam_wd": ps.Adam(lr=0.01, weight_decay=0.01),
    "ftrl": ps.FTRL(alpha=0.1, l1=0.01, l2=0.01),
}
WHY_EQUAL = "equal gradients, k a power of two: each sub-step is one plain push's operations"


def _table(opt: ps.Optimizer, dynamic: bool) -> ps.InProcessStore:
    store = ps.InProcessStore()
    rows = None if dynamic else 64
    store.create_table(ps.TableSpec(name="t", num_rows=rows, dim=DIM, optimizer=opt))
    return store


def _stats(opt: ps.Optimizer, grads: list[torch.Tensor]) -> torch.Tensor:
    """What a cache sends with the sum of ``grads`` (each ``[U, D]``): the optimizer's
    statistic, summed over the updates."""
    q = opt.stat_dim(DIM)
    if q == 0:
        return torch.zeros(grads[0].shape[0], 0)
    if q == 1:
        return torch.stack([g.square().mean(dim=1) for g in grads]).sum(0).unsqueeze(1)
    return torch.stack([g * g for g in grads]).sum(0)


def _state(store: ps.InProcessStore, ids: torch.Tensor) -> torch.Tensor:
    return store.state("t", ids)


def _counted_and_sequential(
    opt: ps.Optimizer, dynamic: bool, ids: torch.Tensor, counts: torch.Tensor, grads: list
) -> tuple[ps.InProcessStore, ps.InProcessStore]:
    """The store after one counted push of ``grads`` (``grads[j]`` ``[U, D]`` is update
    ``j``; row ``u`` takes the first ``counts[u]``) and the one after one push each."""
    counted, seq = _table(opt, dynamic), _table(opt, dynamic)
    for s in (counted, seq):  # the same history first: a plain push of every row
        s.push("t", ids, torch.full((ids.numel(), DIM), 0.25))
    k = int(counts.max())
    mine = [g * (counts > j).unsqueeze(1) for j, g in enumerate(grads[:k])]  # zero past k
    total = torch.stack(mine).sum(0)
    stats = _stats(opt, mine)
    counted.push_many([ps.PushRequest("t", ids, total, counts=counts, stats=stats)])
    for j in range(k):
        live = counts > j
        seq.push("t", ids[live], grads[j][live])
    return counted, seq


@pytest.mark.parametrize("dynamic", [False, True], ids=["fixed", "dynamic"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_equal_gradients_give_the_one_by_one_pushes(name: str, dynamic: bool) -> None:
    opt = OPTIMIZERS[name]
    gen = torch.Generator().manual_seed(7)
    ids = torch.arange(0, 48, 3)  # [16]
    counts = torch.tensor([1, 2, 4, 1, 2, 4, 4, 2] * 2)
    g = torch.randint(-64, 65, (ids.numel(), DIM), generator=gen).float() / 64  # exact
    counted, seq = _counted_and_sequential(opt, dynamic, ids, counts, [g] * 4)
    rows_c, rows_s = counted.pull("t", ids).rows, seq.pull("t", ids).rows
    st_c, st_s = _state(counted, ids), _state(seq, ids)
    kernel = isinstance(opt, ps.RowWiseAdagrad) and not dynamic
    if name == "sgd":  # one step of lr * G against k steps of lr * g: k + 1 terms summed
        tol = sum_tol(torch.float32, 5, float(rows_s.abs().max()) + 4 * opt.lr)
        assert_close(rows_c, rows_s, atol=tol, what="sgd rows", why="one sum in two orders")
        assert_same(st_c, st_s, what="sgd state", why="stateless")
    elif isinstance(opt, ps.Adam) or kernel:
        # Per sub-step one rounding of the moment (Adam) or of the kernel's mean and
        # multiply-adds; a step moves a row by at most lr * |m / sqrt(v)| <= lr * 1.5
        # here, so each rounding moves it by at most a few ulps of that.
        lr = opt.lr
        tol = 4 * 8 * lr * 1.5 * 2.0**-22 + 4 * 8 * float(rows_s.abs().max()) * 2.0**-23
        assert_close(rows_c, rows_s, atol=tol, what=f"{name} rows", why="one rounding a step")
        state_tol = 4 * 8 * float(st_s.abs().max()) * 2.0**-22
        assert_close(st_c, st_s, atol=state_tol, what=f"{name} state", why="one rounding a step")
    else:
        assert_same(rows_c, rows_s, what=f"{name} rows", why=WHY_EQUAL)
        assert_same(st_c, st_s, what=f"{name} state", why=WHY_EQUAL)
    # The clock counts pushes: one more for the counted push, k more for the others.
    assert torch.equal(counted.clocks("t", ids), torch.full((ids.numel(),), 2))
    assert torch.equal(seq.clocks("t", ids), 1 + counts)


@pytest.mark.parametrize("name", ["rowwise_adagrad", "adagrad", "adam", "ftrl"])
def test_unequal_gradients_grow_the_accumulators_exactly(name: str) -> None:
    opt = OPTIMIZERS[name]
    gen = torch.Generator().manual_seed(3)
    ids = torch.arange(10)
    counts = torch.tensor([5, 3, 2, 5, 1, 4, 5, 2, 3, 5])
    grads = [torch.randn(ids.numel(), DIM, generator=gen) for _ in range(5)]
    counted, seq = _counted_and_sequential(opt, True, ids, counts, grads)
    st_c, st_s = _state(counted, ids), _state(seq, ids)
    if isinstance(opt, ps.Adam):  # the step count exactly; v is a decayed sum (docs)
        t = st_c[:, 2 * DIM]
        assert torch.equal(t, st_s[:, 2 * DIM]) and torch.equal(t, 1.0 + counts.float())
        return
    # Sum of squares (Adagrad sum, row-wise accumulator, FTRL n): the same k + 1 terms
    # added in another order.
    acc = {"rowwise_adagrad": slice(0, 1), "adagrad": slice(0, DIM), "ftrl": slice(DIM, 2 * DIM)}
    col = acc[name]
    tol = sum_tol(torch.float32, 6, float(st_s[:, col].abs().max()))
    assert_close(st_c[:, col], st_s[:, col], atol=tol, what=f"{name} accumulator",
                 why="the same squares summed in another order")  # fmt: skip


def test_a_counted_push_moves_hot_rows_as_far_as_the_updates_one_by_one() -> None:
    """What the counts are for: row-wise Adagrad on a row of 5 similar updates. One
    normalised step of the sum moves it about a fifth as far as the 5 updates; the
    counted push moves it as far (within 5 % here, where the gradients differ by 10 %)."""
    opt = ps.RowWiseAdagrad(lr=0.1)
    gen = torch.Generator().manual_seed(0)
    ids = torch.arange(4)
    base = torch.randn(4, DIM, generator=gen)
    grads = [base * (1 + 0.1 * torch.randn(4, 1, generator=gen)) for _ in range(5)]
    counts = torch.full((4,), 5)
    counted, seq = _counted_and_sequential(opt, False, ids, counts, grads)
    once = _table(opt, False)
    once.push("t", ids, torch.full((4, DIM), 0.25))
    start = once.pull("t", ids).rows
    once.push("t", ids, torch.stack(grads).sum(0))
    move = {
        "counted": (counted.pull("t", ids).rows - start).norm(dim=1),
        "sequential": (seq.pull("t", ids).rows - start).norm(dim=1),
        "one step of the sum": (once.pull("t", ids).rows - start).norm(dim=1),
    }
    ratio = move["counted"] / move["sequential"]
    assert bool(((ratio - 1).abs() < 0.05).all()), move
    assert bool((move["one step of the sum"] < 0.5 * move["sequential"]).all()), move


def test_repeated_ids_add_their_counts_and_statistics() -> None:
    opt = OPTIMIZERS["adagrad"]
    a, b = _table(opt, False), _table(opt, False)
    g1, g2 = torch.full((1, DIM), 0.5), torch.full((1, DIM), 0.25)
    ids = torch.tensor([5, 5])
    grads = torch.cat([g1 * 2, g2 * 2])  # each stands for two updates
    stats = torch.cat([2 * g1 * g1, 2 * g2 * g2])
    a.push_many([ps.PushRequest("t", ids, grads, counts=torch.tensor([2, 2]), stats=stats)])
    total = grads.sum(0, keepdim=True)
    b.push_many([ps.PushRequest("t", ids[:1], total, counts=torch.tensor([4]),
                                stats=stats.sum(0, keepdim=True))])  # fmt: skip
    assert_same(a.pull("t", ids[:1]).rows, b.pull("t", ids[:1]).rows, what="rows",
                why="one row of 4 updates either way")  # fmt: skip


@pytest.mark.parametrize(
    ("counts", "stats", "message"),
    [
        (torch.tensor([1, 2]), None, "stats must be a float32 tensor"),
        (torch.tensor([1.0, 2.0]), torch.zeros(2, DIM), "counts must be an int64 tensor"),
        (torch.tensor([1, 0]), torch.zeros(2, DIM), "count 0 for row id 4; counts are >= 1"),
        (torch.tensor([1, 2, 3]), torch.zeros(2, DIM), "counts have shape (3,), expected (2,)"),
        (torch.tensor([1, 2]), torch.zeros(2, 1), "stats have shape (2, 1), expected (2, 8)"),
        (torch.tensor([1, 2]), torch.full((2, DIM), -1.0), "finite and >= 0"),
        (torch.tensor([1, 2]), torch.full((2, DIM), float("nan")), "finite and >= 0"),
    ],
)
def test_bad_counts_or_statistics_are_refused_and_change_nothing(
    counts: torch.Tensor, stats: torch.Tensor | None, message: str
) -> None:
    store = _table(OPTIMIZERS["adagrad"], False)
    ids = torch.tensor([3, 4])
    before = store.pull("t", ids).rows.clone()
    with pytest.raises((ValueError, TypeError), match="table 't'") as err:
        store.push_many([ps.PushRequest("t", ids, torch.ones(2, DIM), counts=counts, stats=stats)])
    assert message in str(err.value), err.value
    assert torch.equal(store.pull("t", ids).rows, before)
    assert torch.equal(store.clocks("t", ids), torch.zeros(2, dtype=torch.int64))


def test_a_store_that_cannot_carry_counts_refuses_them() -> None:
    """A store on the base class's batched push (one ``push_async`` per table) would
    drop the counts: it refuses a counted push, and changes nothing."""
    from wrapped_store import WrappedStore

    store = WrappedStore()
    store.create_table(ps.TableSpec(name="t", num_rows=10, dim=DIM, optimizer=OPTIMIZERS["adam"]))
    assert not store.counted_pushes
    req = ps.PushRequest("t", torch.tensor([1]), torch.ones(1, DIM), torch.tensor([2]),
                         torch.ones(1, DIM))  # fmt: skip
    with pytest.raises(ValueError, match="'t'.*does not take counted pushes"):
        store.push_many([req])
    assert torch.equal(store.clocks("t", torch.tensor([1])), torch.zeros(1, dtype=torch.int64))


def test_one_pass_over_mixed_counts_equals_plain_and_counted_pushes_apart() -> None:
    """A counted push on a fixed row-wise Adagrad table is one C pass over every row; its
    rows of one update must take a plain push's step. Reference: the same rows split, the
    one-update rows as a plain push and the others as a counted push of those alone."""
    opt = ps.RowWiseAdagrad(lr=0.1)
    gen = torch.Generator().manual_seed(3)
    ids = torch.arange(0, 64, 3)  # [22] distinct, sorted
    counts = torch.randint(1, 4, (ids.numel(),), generator=gen)
    counts[:2] = torch.tensor([1, 2])  # both kinds, whatever the draw
    grads = torch.randn(ids.numel(), DIM, generator=gen)
    stats = grads.square().mean(dim=1, keepdim=True) * counts.unsqueeze(1)
    one, split = _table(opt, False), _table(opt, False)
    one.push_many([ps.PushRequest("t", ids, grads, counts=counts, stats=stats)])
    single, many = counts == 1, counts > 1
    split.push("t", ids[single], grads[single])
    split.push_many(
        [ps.PushRequest("t", ids[many], grads[many], counts=counts[many], stats=stats[many])]
    )
    why = "each row takes the same C row step on both sides, rows are independent"
    assert_same(one.pull("t", ids).rows, split.pull("t", ids).rows, what="rows", why=why)
    assert_same(_state(one, ids), _state(split, ids), what="state", why=why)
    assert torch.equal(one.clocks("t", ids), split.clocks("t", ids))


@pytest.mark.parametrize("name", ["rowwise_adagrad", "adagrad", "adam", "ftrl"])
def test_one_update_per_row_is_the_plain_push_and_its_unused_statistics_go_unchecked(
    name: str,
) -> None:
    """Every count 1 over distinct sorted ids is a plain push (``ps.validate.plain_counted``):
    the store applies the gradients as one, bit for bit, without reading the statistics,
    so only their dtype and shape are checked. A count above 1 reads them: checked."""
    opt = OPTIMIZERS[name]
    counted, plain = _table(opt, False), _table(opt, False)
    ids = torch.tensor([2, 5, 9])
    grads = torch.randn(3, DIM, generator=torch.Generator().manual_seed(4))
    unused = torch.full((3, opt.stat_dim(DIM)), float("nan"))
    counted.push_many([ps.PushRequest("t", ids, grads, torch.ones(3, dtype=torch.int64), unused)])
    plain.push("t", ids, grads)
    assert_same(counted.pull("t", ids).rows, plain.pull("t", ids).rows, what="rows",
                why="a plain push either way")  # fmt: skip
    assert_same(counted.state("t", ids), plain.state("t", ids), what="state", why="the same")
    with pytest.raises(ValueError, match="stats must be finite and >= 0"):
        counts = torch.tensor([1, 2, 1])
        counted.push_many([ps.PushRequest("t", ids, grads, counts, unused)])
    with pytest.raises(ValueError, match=r"stats have shape \(3, 0\)"):
        counted.push_many(
            [ps.PushRequest("t", ids, grads, torch.ones(3, dtype=torch.int64), unused[:, :0])]
        )


@pytest.mark.parametrize("dim", [8, 64, 100, 130])
def test_counted_kernel_is_the_substeps_replayed_in_order(dim: int) -> None:
    """The C kernel's counted rows against a numpy replay of its sub-steps, one value at a
    time in float32 (numpy fuses nothing, as the kernel's ``fp-contract=off``): ``k``
    times ``acc += s / k``, ``row += -lr * ((g / k) / (sqrt(acc) + eps))``. Bit for bit,
    at dims below, at and past the kernel's blocks of columns."""
    from ps.kernels import rowwise_adagrad

    if rowwise_adagrad.load() is None:
        pytest.skip("no C compiler: the torch path runs instead")
    gen = torch.Generator().manual_seed(dim)
    n, lr, eps = 12, 0.05, 1e-8
    weight = torch.randn(20, dim, generator=gen)
    state = torch.rand(20, 1, generator=gen) + 0.1
    clocks = torch.zeros(20, dtype=torch.int64)
    rows = torch.randperm(20, generator=gen)[:n]
    counts = torch.randint(2, 9, (n,), generator=gen)  # k > 1: the sub-steps' path
    grad = torch.randn(n, dim, generator=gen) * counts.unsqueeze(1)
    stats = torch.rand(n, 1, generator=gen) * counts.unsqueeze(1)
    want_w, want_s = weight.numpy().copy(), state.numpy().copy()
    f32 = np.float32
    for i, r in enumerate(rows.tolist()):
        k = f32(counts[i].item())
        q, acc = f32(stats[i, 0].item()) / k, want_s[r, 0]
        mean = grad[i].numpy() / k  # [D] float32
        for _ in range(int(counts[i])):
            acc = f32(acc + q)
            denom = f32(np.sqrt(acc) + f32(eps))
            want_w[r] = want_w[r] + f32(-lr) * (mean / denom)
        want_s[r, 0] = acc
    assert rowwise_adagrad.rowwise_adagrad_counted_(
        weight, state, clocks, rows, grad, counts, stats, lr=lr, eps=eps
    )
    assert_same(weight, torch.from_numpy(want_w), what="rows", why="the same float32 operations")
    assert_same(state, torch.from_numpy(want_s), what="state", why="the same float32 operations")
    assert torch.equal(clocks[rows], torch.ones(n, dtype=torch.int64))
