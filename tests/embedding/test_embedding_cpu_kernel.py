"""The C kernel of the CPU fused backward (ps/kernels/rowwise_adagrad.py) against the ps math.

Reference: per-id gradients summed per unique row by ``index_add_``, then
``ps.RowWiseAdagrad.apply`` (the parameter server's own update) on copies of the
touched rows, in float32 and replayed in float64 (the tolerance: the float32
reference's own rounding error, ``tests/support/tolerance.py``); untouched rows must not
change at all. Also the whole local collection with the kernel vs with it disabled
(the torch path), in subprocesses.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from embedding_reference import UPDATE_ROUNDINGS
from multiproc import rank_env
from ps import RowWiseAdagrad
from ps.kernels import rowwise_adagrad
from tolerance import assert_close, assert_same, replay_tol

pytestmark = [
    pytest.mark.numerics,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not rowwise_adagrad.available(), reason="no C compiler: torch path only"),
]

ROOT = Path(__file__).resolve().parents[2]
SUPPORT = Path(__file__).resolve().parents[1] / "support"  # the helpers _TRAIN imports
REPLAY_WHY = (
    "4x the fp32 reference's own rounding error, measured by its float64 replay; never "
    "below the roundings of the row's gradient sum and one update"
)


def _reference(
    weight: torch.Tensor,
    state: torch.Tensor,
    ids: torch.Tensor,
    bag_of: torch.Tensor,
    grad: torch.Tensor,
    weights: torch.Tensor | None,
    opt: RowWiseAdagrad,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The step in ``dtype`` (float32: the reference; float64: its replay)."""
    per_id = grad.to(dtype)[bag_of]  # [N, D]
    if weights is not None:
        per_id = per_id * weights.to(dtype).unsqueeze(1)
    rows = torch.unique(ids)  # [U]
    pos = torch.searchsorted(rows, ids)  # [N]
    g = torch.zeros(rows.numel(), grad.shape[1], dtype=dtype).index_add_(0, pos, per_id)
    w, s = weight.to(dtype, copy=True), state.to(dtype, copy=True)
    wr, sr = w[rows], s[rows]
    opt.apply(wr, sr, g)
    w[rows], s[rows] = wr, sr
    return w, s


@pytest.mark.parametrize("n, weighted, threads", [(0, False, 1), (7, False, 1), (300, True, 1),
                                                  (9000, False, 2), (9000, True, 2)])  # fmt: skip
def test_kernel_equals_ps_rowwise_adagrad(n: int, weighted: bool, threads: int) -> None:
    gen = torch.Generator().manual_seed(n)
    rows, d, nbags = 5000, 24, max(1, n // 3)
    opt = RowWiseAdagrad(lr=0.05, eps=1e-6, initial_accumulator=0.1)
    weight = torch.randn(rows, d, generator=gen)
    state = torch.rand(rows, 1, generator=gen)
    clocks = torch.zeros(rows, dtype=torch.int64)
    hot = torch.randint(0, 40, (n,), generator=gen)  # many repeats, some rows in long runs
    ids = torch.where(torch.rand(n, generator=gen) < 0.5, hot, torch.randint(0, rows, (n,)))
    bag_of = torch.randint(0, nbags, (n,), generator=gen)
    grad = torch.randn(nbags, d, generator=gen)
    weights = torch.rand(n, generator=gen) + 0.5 if weighted else None
    weight0, state0 = weight.clone(), state.clone()
    want_w, want_s = _reference(weight, state, ids, bag_of, grad, weights, opt, torch.float32)
    w64, s64 = _reference(weight, state, ids, bag_of, grad, weights, opt, torch.float64)
    occ = int(torch.unique(ids, return_counts=True)[1].max()) if n else 0
    srt, perm = torch.sort(ids)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ok = rowwise_adagrad.rowwise_adagrad_(
            weight, state, clocks, srt, grad, lr=opt.lr, eps=opt.eps, perm=perm,
            bag_of=bag_of, weights=weights,
        )  # fmt: skip
    finally:
        torch.set_num_threads(old)
    assert ok
    # A row's gradient sums up to ``occ`` terms; the accumulator of squares doubles that
    # relative error and adds a mean over ``d``.
    assert_close(
        weight, want_w, atol=replay_tol(want_w, w64, floor_terms=occ + UPDATE_ROUNDINGS),
        what="rows", why=REPLAY_WHY,
    )  # fmt: skip
    assert_close(
        state, want_s, atol=replay_tol(want_s, s64, floor_terms=2 * occ + d + UPDATE_ROUNDINGS),
        what="state", why=REPLAY_WHY,
    )  # fmt: skip
    untouched = torch.ones(rows, dtype=torch.bool)
    untouched[ids] = False
    never = "the kernel never writes a row that no id names"
    assert_same(weight[untouched], weight0[untouched], what="untouched rows", why=never)
    assert_same(state[untouched], state0[untouched], what="untouched state", why=never)
    want_clocks = torch.zeros(rows, dtype=torch.int64)
    want_clocks[torch.unique(ids)] = 1
    assert torch.equal(clocks, want_clocks)


@pytest.mark.parametrize(
    "one_each, weighted, threads",
    [(True, False, 1), (False, True, 1), (True, True, 2), (False, False, 2)],
)
def test_parts_kernel_reads_split_gradients_in_place(
    one_each: bool, weighted: bool, threads: int
) -> None:
    """The per-feature form (gradients as autograd hands them back: strided views of
    one ``[B, N, D]`` tensor, an expanded row, a contiguous block) equals the kernel on
    their concatenation, bit for bit."""
    gen = torch.Generator().manual_seed(3 + threads)
    rows, d, b = 3000, 16, 2500  # 3 features x 2500 bags: 7500 ids, 2 threads split them
    opt = RowWiseAdagrad(lr=0.05, eps=1e-6, initial_accumulator=0.1)
    lengths = torch.ones(3 * b, dtype=torch.int64)
    if not one_each:
        lengths = torch.randint(0, 3, (3 * b,), generator=gen)  # empty bags, repeats
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    n = int(offsets[-1])
    ids = torch.randint(0, rows, (n,), generator=gen)
    ids[: n // 2] %= 50  # hot rows
    weights = torch.rand(n, generator=gen) + 0.5 if weighted else None
    block = torch.randn(b, 4, d, generator=gen)
    parts = [block[:, 1], torch.randn(1, d, generator=gen).expand(b, d), block[:, 3]]
    whole = torch.cat(parts).contiguous()  # [3B, D]
    bag_of = torch.repeat_interleave(torch.arange(3 * b), lengths)
    srt, perm = torch.sort(ids)
    start = [torch.randn(rows, d, generator=gen), torch.rand(rows, 1, generator=gen)]
    got = [t.clone() for t in start] + [torch.zeros(rows, dtype=torch.int64)]
    want = [t.clone() for t in start] + [torch.zeros(rows, dtype=torch.int64)]
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert rowwise_adagrad.rowwise_adagrad_parts_(
            *got, srt, perm, None if one_each else offsets, parts,
            lr=opt.lr, eps=opt.eps, weights=weights,
        )  # fmt: skip
        assert rowwise_adagrad.rowwise_adagrad_(
            *want, srt, whole, lr=opt.lr, eps=opt.eps, perm=perm, bag_of=bag_of,
            weights=weights,
        )  # fmt: skip
    finally:
        torch.set_num_threads(old)
    same = (
        "one C core (fp-contract off) for both: the same rows summed in the same order from "
        "the same gradient values, split over the same threads; only where each bag's "
        "gradient row is read from differs"
    )
    for what, x, y in zip(("rows", "state", "clocks"), got, want, strict=True):
        assert_same(x, y, what=f"parts vs concatenated: {what}", why=same)


def test_kernel_rejects_what_it_cannot_handle() -> None:
    w = torch.zeros(4, 3)
    s = torch.zeros(4, 1)
    c = torch.zeros(4, dtype=torch.int64)
    ids = torch.tensor([0, 2])
    g = torch.ones(2, 3)
    assert not rowwise_adagrad.rowwise_adagrad_(w.t().contiguous().t(), s, c, ids, g, lr=1, eps=1)
    assert not rowwise_adagrad.rowwise_adagrad_(w.double(), s, c, ids, g, lr=1, eps=1)
    assert not rowwise_adagrad.rowwise_adagrad_(w, s, c, ids.int(), g, lr=1, eps=1)
    assert not rowwise_adagrad.rowwise_adagrad_(w, torch.zeros(4, 0), c, ids, g, lr=1, eps=1)
    assert_same(w, torch.zeros(4, 3), what="rows", why="every call was refused: nothing written")


# The same training with the kernel and without; alongside it the fp32 reference of
# tests/support/embedding_reference.py and its float64 replay, whose tolerances are printed last.
_TRAIN = """
import json
import torch
from embedding import EmbeddingCollection, KeyedJaggedIds, RowWiseAdagrad, TableConfig
from embedding_reference import Replayed
torch.manual_seed(0)
tables = [
    TableConfig(name="a", num_rows=3000, dim=16, feature_names=["x", "y"], pooling="mean",
                optimizer=RowWiseAdagrad(lr=0.1)),
    TableConfig(name="b", num_rows=500, dim=16, feature_names=["z"], pooling="sum",
                optimizer=RowWiseAdagrad(lr=0.2)),
]
ec = EmbeddingCollection(tables)
rep = Replayed(tables)
for step in range(4):
    lists = {f: [torch.randint(0, 60, (int(torch.randint(0, 4, ())),)).tolist()
                 for _ in range(2000)] for f in ["x", "y", "z"]}
    kjt = KeyedJaggedIds.from_lists(lists)
    out = ec(kjt)
    want, want64 = rep.forward(kjt)
    targets = {f: torch.randn_like(o) for f, o in out.items()}
    for outs in (out, want, want64):
        sum((o * targets[f]).sum() for f, o in outs.items()).backward()
    rep.step(kjt)
ids = torch.arange(500)
print(json.dumps([ec.local.rows(t, ids).tolist() for t in "ab"]))
print(json.dumps([ec.local.state(t, ids).tolist() for t in "ab"]))
print(json.dumps([[rep.rows_tol(t) for t in "ab"], [rep.state_tol(t) for t in "ab"]]))
"""


def test_collection_same_with_and_without_kernel() -> None:
    outs, tols = [], []
    for flag in ("1", "0"):
        env = rank_env(pythonpath=(SUPPORT,), HYBRIDREC_CPU_KERNEL=flag)
        done = subprocess.run(
            [sys.executable, "-c", _TRAIN], capture_output=True, text=True, env=env, timeout=100
        )
        assert done.returncode == 0, done.stderr
        *tables, tol = done.stdout.splitlines()
        outs.append([torch.tensor(json.loads(line)) for line in tables])
        tols.append(json.loads(tol))
    assert tols[0] == tols[1], "the reference does not depend on the kernel"
    for what, kernel, torch_path, atol in zip(("rows", "state"), *outs, tols[0], strict=True):
        for k, name in enumerate("ab"):
            assert_close(
                kernel[k], torch_path[k], atol=atol[k], what=f"table {name} {what}",
                why=REPLAY_WHY,
            )  # fmt: skip


# Id ranges on both sides of the one-word sort (keys below 2^32: 2**31 with negatives
# spans just under it) and far past it.
SORT_CASES = [(0, 5), (1, 5), (7, 3), (5000, 1), (53_000, 2_600_000), (1000, 2**31),
              (1000, 2**32), (1000, 2**62)]  # fmt: skip


def _ids(n: int, high: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(n + high % 997)
    ids = torch.randint(0, high, (n,), generator=gen)
    ids[::3] = -ids[::3]  # negative ids too (a full int64 range)
    return ids


@pytest.mark.parametrize("n, high", SORT_CASES)
def test_radix_sort_equals_stable_torch_sort(n: int, high: int) -> None:
    ids = _ids(n, high)
    got = rowwise_adagrad.sort_ids(ids)
    want = torch.sort(ids, stable=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
@pytest.mark.parametrize("n, high", SORT_CASES)
def test_dedup_equals_torch_unique_and_the_stable_sort(
    n: int, high: int, kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not kernel:  # the path taken where no C compiler is found
        monkeypatch.setattr(rowwise_adagrad, "load", lambda: None)
    ids = _ids(n, high)
    perm, unique, counts, index = rowwise_adagrad.dedup_ids(ids)
    want_unique, want_index, want_counts = torch.unique(
        ids, sorted=True, return_inverse=True, return_counts=True
    )
    assert torch.equal(perm, torch.sort(ids, stable=True)[1])
    assert torch.equal(unique, want_unique) and torch.equal(counts, want_counts)
    assert torch.equal(index, want_index) and torch.equal(unique[index], ids)
