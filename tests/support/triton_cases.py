"""Cases for the Triton kernels against a plain torch reference; run as a script.

``python tests/support/triton_cases.py --device cpu`` runs every case in Triton's
interpreter (it sets ``TRITON_INTERPRET=1`` before triton is imported, because
Triton reads it when a kernel is defined) and prints one JSON line per case:
``{"case": name, "ok": bool, "error": str}``. ``--device cuda`` runs the same
cases compiled on a GPU. Before the cases, one more line (``IMPORT_CHECK``) says whether
importing ``embedding.kernels`` imported triton. Exit status 1 if any case failed.
``tests/embedding/test_triton_kernels.py`` runs this in a subprocess, one pytest test per case.

Reference: ``F.embedding_bag`` (autograd for the row gradients), then row-wise
Adagrad written out by hand (checked once against ``ps.optimizers.RowWiseAdagrad``)
and, for every ps optimizer (``case_opt_*``), the optimizer's own ``apply`` on
the touched rows, always computed on CPU.

Tolerances (``tests/support/tolerance.py``): a pooling against ``F.embedding_bag`` at the worst
case of one sum per bag in two orders (:func:`pool_tol`); optimizer steps at the replay
tolerance of the fp32 reference against the same reference in float64
(:func:`close_replayed`); what the kernels never write, and two runs of one kernel on
the same inputs, bit for bit.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from embedding_reference import UPDATE_ROUNDINGS
from tolerance import assert_close, assert_same, replay_tol, sum_tol


@dataclass(kw_only=True, slots=True)
class Batch:
    """A flat table-batched lookup problem: weight [R, D], ids [N], offsets [B+1], psw [N]."""

    weight: torch.Tensor
    ids: torch.Tensor
    offsets: torch.Tensor
    psw: torch.Tensor | None


def make_batch(
    *,
    seed: int,
    table_rows: list[int],
    dim: int,
    batch: int,
    max_len: int,
    weighted: bool,
    device: str,
    empty_frac: float = 0.2,
    hot: int = 0,
) -> Batch:
    """Random bags for every table (feature-major: table t's bags are t*batch .. t*batch+batch-1).

    Ids are offset by their table's base row. ``hot`` > 0 draws ids from the first
    ``hot`` rows of each table only, forcing many repeats.
    """
    g = torch.Generator().manual_seed(seed)
    total = sum(table_rows)
    weight = torch.randn(total, dim, generator=g)
    ids, lengths = [], []
    base = 0
    for rows in table_rows:
        for _ in range(batch):
            n = (
                0
                if torch.rand(1, generator=g).item() < empty_frac
                else int(torch.randint(1, max_len + 1, (1,), generator=g))
            )
            hi = min(rows, hot) if hot else rows
            ids.append(torch.randint(0, hi, (n,), generator=g) + base)
            lengths.append(n)
        base += rows
    flat = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int64)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    psw = torch.rand(flat.numel(), generator=g) * 2 - 0.5 if weighted else None
    return Batch(
        weight=weight.to(device),
        ids=flat.to(device),
        offsets=offsets.to(device),
        psw=psw.to(device) if psw is not None else None,
    )


def ref_pool(b: Batch, mode: str, weight: torch.Tensor | None = None) -> torch.Tensor:
    """F.embedding_bag; weighted mean (which it refuses) as weighted sum / bag length."""
    w = b.weight if weight is None else weight
    if b.psw is not None and mode == "mean":
        s = F.embedding_bag(
            b.ids, w, b.offsets, mode="sum", per_sample_weights=b.psw, include_last_offset=True
        )
        lengths = (b.offsets[1:] - b.offsets[:-1]).clamp_min(1).to(s.dtype)
        return s / lengths[:, None]
    return F.embedding_bag(
        b.ids, w, b.offsets, mode=mode, per_sample_weights=b.psw, include_last_offset=True
    )


def ref_step(
    b: Batch, state: torch.Tensor, grad_out: torch.Tensor, mode: str, lr: float, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One reference step on copies: autograd row gradients, then row-wise Adagrad by hand."""
    w = b.weight.detach().clone().requires_grad_(True)
    (ref_pool(b, mode, w) * grad_out).sum().backward()
    assert w.grad is not None
    new_w, new_s = b.weight.detach().clone(), state.clone()
    touched = torch.unique(b.ids)  # [U]
    g = w.grad[touched]  # [U, D]
    acc = new_s[touched] + g.square().mean(dim=1)  # [U]
    step = g / (acc.sqrt() + eps).unsqueeze(1)  # [U, D]
    new_s[touched] = acc
    new_w[touched] = new_w[touched].add(step, alpha=-lr)
    return new_w, new_s


# --- tolerances (tests/support/tolerance.py) ---------------------------------------------------

REPLAY_WHY = (
    "4x the fp32 reference's own rounding error, measured by its float64 replay; never "
    "below the roundings of the last step (the row's gradient sum and one update)"
)


def f64(b: Batch) -> Batch:
    """``b`` with its rows and per-sample weights in float64: the replay that measures how
    far float32 rounding moves the reference."""
    return Batch(
        weight=b.weight.double(),
        ids=b.ids,
        offsets=b.offsets,
        psw=None if b.psw is None else b.psw.double(),
    )


def occurrences(ids: torch.Tensor) -> int:
    """The most times one id occurs in ``ids``: the terms of the largest row gradient."""
    if ids.numel() == 0:
        return 0
    return int(torch.unique(ids, return_counts=True)[1].max())


def rows_terms(occ: int) -> int:
    """Roundings of one row element in the last step: a gradient summed from ``occ`` terms,
    then the optimizer's update."""
    return occ + UPDATE_ROUNDINGS


def state_terms(occ: int, dim: int) -> int:
    """Roundings of one state element in the last step: an accumulator of squares doubles
    the gradient's relative error, row-wise Adagrad adds a mean over ``dim``."""
    return 2 * occ + dim + UPDATE_ROUNDINGS


def pool_tol(b: Batch, mode: str) -> float:
    """Two fp32 poolings of ``b`` (the kernel's and ``F.embedding_bag``'s): per bag a sum of
    up to ``n`` products ``psw_i * row_i`` plus the rounding of a mean's ``1 / len`` and its
    product, so ``n + 2`` roundings, over the largest ``sum_i |psw_i| |row_i|`` of any bag
    (divided by its length for a mean), computed in float64."""
    if b.ids.numel() == 0:
        return 0.0
    mags = Batch(
        weight=b.weight.double().abs(),
        ids=b.ids,
        offsets=b.offsets,
        psw=None if b.psw is None else b.psw.double().abs(),
    )
    longest = int((b.offsets[1:] - b.offsets[:-1]).max())
    return sum_tol(torch.float32, longest + 2, float(ref_pool(mags, mode).max()))


def close_pool(out: torch.Tensor, b: Batch, mode: str, what: str = "pooled") -> None:
    """The kernel's pooling of ``b`` against ``F.embedding_bag`` at :func:`pool_tol`."""
    assert_close(
        out.cpu(),
        ref_pool(b, mode).cpu(),
        atol=pool_tol(b, mode),
        what=f"{what} ({mode})",
        why="one sum per bag in two orders: n + 2 roundings of the bag's sum of |terms|",
    )


def close_replayed(
    actual: torch.Tensor,
    expected: torch.Tensor,
    ref: torch.Tensor,
    ref64: torch.Tensor,
    *,
    floor_terms: int,
    what: str,
    slot: int | None = None,
) -> None:
    """``actual`` within :func:`replay_tol` ``(ref, ref64)`` of ``expected`` (two fp32 runs
    of the computation whose fp32 reference is ``ref``, replayed in float64 as ``ref64``;
    often ``expected`` is ``ref``). With ``slot`` = D, an optimizer's state is compared in
    groups of D columns (moments, accumulators, step counts: each on its own scale)."""
    actual, expected, ref, ref64 = (t.cpu() for t in (actual, expected, ref, ref64))
    if slot is None or ref.dim() != 2 or ref.shape[1] == 0:
        parts = [(actual, expected, ref, ref64)]
    else:
        parts = list(
            zip(*(t.split(slot, dim=1) for t in (actual, expected, ref, ref64)), strict=True)
        )
    for k, (a, e, r, r64) in enumerate(parts):
        assert_close(
            a,
            e,
            atol=replay_tol(r, r64, floor_terms=floor_terms),
            what=what if len(parts) == 1 else f"{what}, state columns {k * slot}..",
            why=REPLAY_WHY,
        )


def kernels(device: str) -> tuple[Callable[..., torch.Tensor], Callable[..., None]]:
    """The forward and the fused backward with row-wise Adagrad (``lr``, ``eps`` kwargs)."""
    from embedding.kernels.triton_optimizers import fused_backward_
    from embedding.kernels.triton_pool import pooled_lookup
    from ps.optimizers import RowWiseAdagrad

    def rowwise_adagrad_backward(*args: Any, lr: float, eps: float, **kw: Any) -> None:
        fused_backward_(*args, RowWiseAdagrad(lr=lr, eps=eps), **kw)

    return pooled_lookup, rowwise_adagrad_backward


def check_forward(b: Batch, mode: str, device: str) -> None:
    pooled_lookup, _ = kernels(device)
    out = pooled_lookup(b.weight, b.ids, b.offsets, mode=mode, per_sample_weights=b.psw)
    close_pool(out, b, mode)
    empty = (b.offsets[1:] == b.offsets[:-1]).nonzero().flatten()
    assert bool((out[empty] == 0).all()), "empty bags must pool to exact zeros"


def check_backward(
    b: Batch,
    mode: str,
    device: str,
    *,
    steps: int = 1,
    init_state: float = 0.0,
    lr: float = 0.05,
    eps: float = 1e-8,
) -> None:
    """``steps`` fused steps equal ``steps`` reference steps; untouched rows bitwise unchanged."""
    _, fused = kernels(device)
    rows, dim = b.weight.shape
    g = torch.Generator().manual_seed(1234)
    w_ref, s_ref = b.weight.clone(), torch.full((rows,), init_state, device=device)
    w_ref64, s_ref64 = w_ref.double(), s_ref.double()
    w, s = b.weight.clone(), s_ref.clone()
    clocks = torch.zeros(rows, dtype=torch.int64, device=device)
    for _ in range(steps):
        grad_out = torch.randn(b.offsets.numel() - 1, dim, generator=g).to(device)
        step_b = Batch(weight=w_ref, ids=b.ids, offsets=b.offsets, psw=b.psw)
        w_ref, s_ref = ref_step(step_b, s_ref, grad_out, mode, lr, eps)
        step64 = f64(Batch(weight=w_ref64, ids=b.ids, offsets=b.offsets, psw=b.psw))
        w_ref64, s_ref64 = ref_step(step64, s_ref64, grad_out.double(), mode, lr, eps)
        fused(
            w, s, b.ids, b.offsets, grad_out,
            mode=mode, per_sample_weights=b.psw, lr=lr, eps=eps, clocks=clocks,
        )  # fmt: skip
    occ = occurrences(b.ids)
    close_replayed(s, s_ref, s_ref, s_ref64, floor_terms=state_terms(occ, dim), what="state")
    close_replayed(w, w_ref, w_ref, w_ref64, floor_terms=rows_terms(occ), what="weight")
    untouched = torch.ones(rows, dtype=torch.bool, device=device)
    untouched[b.ids] = False
    assert_same(
        w[untouched], b.weight[untouched], what="untouched rows", why="the kernel never writes them"
    )
    assert bool((s[untouched] == init_state).all()), "untouched state changed"
    expect = torch.zeros(rows, dtype=torch.int64, device=device)
    expect[torch.unique(b.ids)] = steps
    assert torch.equal(clocks, expect), "clocks must count one update per touched row per step"


# --- the cases -------------------------------------------------------------------------


def _b(device: str, **kw: object) -> Batch:
    args: dict = dict(seed=0, table_rows=[50], dim=16, batch=12, max_len=5, weighted=False)
    args.update(kw)
    return make_batch(device=device, **args)


def case_fwd_sum(device: str) -> None:
    check_forward(_b(device), "sum", device)


def case_fwd_mean(device: str) -> None:
    check_forward(_b(device, seed=1), "mean", device)


def case_fwd_weighted_sum(device: str) -> None:
    check_forward(_b(device, seed=2, weighted=True), "sum", device)


def case_fwd_weighted_mean(device: str) -> None:
    check_forward(_b(device, seed=3, weighted=True), "mean", device)


def case_fwd_multi_table_odd_dim(device: str) -> None:
    b = _b(device, seed=4, table_rows=[7, 30, 5], dim=13, batch=6, weighted=True)
    check_forward(b, "sum", device)
    check_forward(b, "mean", device)


def case_fwd_wide_dim_long_bags(device: str) -> None:
    # D = 300 > MAX_BLOCK_D (256): two column tiles; bags of up to 40 ids > BLOCK_N (16).
    b = _b(device, seed=5, table_rows=[9], dim=300, batch=4, max_len=40, hot=4)
    check_forward(b, "sum", device)
    check_forward(b, "mean", device)


def case_fwd_all_empty_and_no_bags(device: str) -> None:
    b = _b(device, seed=6, empty_frac=1.0)
    assert b.ids.numel() == 0
    check_forward(b, "sum", device)
    check_forward(b, "mean", device)
    pooled_lookup, _ = kernels(device)
    none = torch.zeros(1, dtype=torch.int64, device=device)
    out = pooled_lookup(b.weight, b.ids, none, mode="sum")
    assert out.shape == (0, 16), out.shape


def case_fwd_int32_ids(device: str) -> None:
    b = _b(device, seed=7, weighted=True)
    b32 = Batch(weight=b.weight, ids=b.ids.int(), offsets=b.offsets.int(), psw=b.psw)
    pooled_lookup, _ = kernels(device)
    out = pooled_lookup(b32.weight, b32.ids, b32.offsets, mode="sum", per_sample_weights=b.psw)
    close_pool(out, b, "sum", what="pooled with int32 ids")


def case_bwd_sum(device: str) -> None:
    check_backward(_b(device, seed=10), "sum", device)


def case_bwd_mean(device: str) -> None:
    check_backward(_b(device, seed=11), "mean", device)


def case_bwd_weighted_sum(device: str) -> None:
    check_backward(_b(device, seed=12, weighted=True), "sum", device)


def case_bwd_weighted_mean(device: str) -> None:
    check_backward(_b(device, seed=13, weighted=True), "mean", device)


def case_bwd_repeated_ids_three_steps(device: str) -> None:
    # 8 hot rows, bags up to 40 ids: a row occurs many times within and across bags.
    b = _b(device, seed=14, table_rows=[20], batch=10, max_len=40, hot=8, weighted=True)
    check_backward(b, "sum", device, steps=3, init_state=0.1)


def case_bwd_multi_table_odd_dim(device: str) -> None:
    b = _b(device, seed=15, table_rows=[7, 30, 5], dim=13, batch=6, weighted=True)
    check_backward(b, "sum", device, steps=2)
    check_backward(b, "mean", device, steps=2)


def case_bwd_wide_dim(device: str) -> None:
    # D = 1100 > MAX_BLOCK_D (128): nine column blocks; row-wise Adagrad's two passes.
    b = _b(device, seed=16, table_rows=[6], dim=1100, batch=3, max_len=8, hot=3)
    check_backward(b, "mean", device, steps=2)


def case_bwd_large_eps(device: str) -> None:
    # A large eps (and lr) makes "eps outside the sqrt" and the order of the update visible.
    b = _b(device, seed=20, weighted=True)
    check_backward(b, "sum", device, steps=2, init_state=0.04, lr=0.7, eps=0.3)


def case_bwd_empty(device: str) -> None:
    b = _b(device, seed=17, empty_frac=1.0)
    check_backward(b, "sum", device)


def case_bwd_state_2d_matches_ps(device: str) -> None:
    # state [R, 1] (the ps layout) is accepted; the hand-written reference equals ps's apply.
    from ps.optimizers import RowWiseAdagrad

    b = _b(device, seed=18, weighted=True)
    _, fused = kernels(device)
    rows, dim = b.weight.shape
    grad_out = torch.randn(b.offsets.numel() - 1, dim, generator=torch.Generator().manual_seed(3))
    grad_out = grad_out.to(device)
    w, s = b.weight.clone(), torch.full((rows, 1), 0.5, device=device)
    fused(w, s, b.ids, b.offsets, grad_out, mode="sum", per_sample_weights=b.psw, lr=0.1, eps=1e-6)
    s0 = torch.full((rows,), 0.5, device=device)
    w_ref, s_ref = ref_step(b, s0, grad_out, "sum", 0.1, 1e-6)
    w_ref64, s_ref64 = ref_step(f64(b), s0.double(), grad_out.double(), "sum", 0.1, 1e-6)
    occ = occurrences(b.ids)
    close_replayed(w, w_ref, w_ref, w_ref64, floor_terms=rows_terms(occ), what="weight")
    close_replayed(s[:, 0], s_ref, s_ref, s_ref64, floor_terms=state_terms(occ, dim), what="state")
    # ps.optimizers.RowWiseAdagrad on the touched rows gives the same reference step.
    wg = b.weight.clone().requires_grad_(True)
    (ref_pool(b, "sum", wg) * grad_out).sum().backward()
    assert wg.grad is not None
    touched = torch.unique(b.ids)
    rows_ps = b.weight[touched].clone()
    state_ps = torch.full((touched.numel(), 1), 0.5, device=device)
    RowWiseAdagrad(lr=0.1, eps=1e-6).apply(rows_ps, state_ps, wg.grad[touched])
    same = (
        "the same torch ops in the same order (square, mean over D, add, sqrt, + eps, divide, "
        "add with alpha) on the same gradients, in contiguous [U, D] and [U] tensors"
    )
    assert_same(w_ref[touched], rows_ps, what="rows: reference step vs ps apply", why=same)
    assert_same(s_ref[touched], state_ps[:, 0], what="state: reference step vs ps apply", why=same)


def case_bwd_coalesced_rows(device: str) -> None:
    # apply_rows_ (gradients already coalesced per row) with row-wise Adagrad equals ps's apply.
    from embedding.kernels.triton_optimizers import apply_rows_
    from ps.optimizers import RowWiseAdagrad

    g = torch.Generator().manual_seed(21)
    weight = torch.randn(40, 19, generator=g).to(device)
    rows = torch.randperm(40, generator=g)[:11].to(device)
    grads = torch.randn(11, 19, generator=g).to(device)
    w, s = weight.clone(), torch.full((40, 1), 0.2, device=device)
    clocks = torch.zeros(40, dtype=torch.int64, device=device)
    apply_rows_(w, s, rows, grads, RowWiseAdagrad(lr=0.3, eps=0.1), clocks=clocks)
    w_ref, s_ref = weight[rows].clone(), torch.full((11, 1), 0.2, device=device)
    RowWiseAdagrad(lr=0.3, eps=0.1).apply(w_ref, s_ref, grads)
    w_ref64 = weight[rows].double()
    s_ref64 = torch.full((11, 1), 0.2, dtype=torch.float64, device=device)
    RowWiseAdagrad(lr=0.3, eps=0.1).apply(w_ref64, s_ref64, grads.double())
    # One coalesced gradient per row: a single term, no sum.
    close_replayed(w[rows], w_ref, w_ref, w_ref64, floor_terms=rows_terms(1), what="rows")
    close_replayed(s[rows], s_ref, s_ref, s_ref64, floor_terms=state_terms(1, 19), what="state")
    assert int(clocks.sum()) == 11 and int(clocks[rows].min()) == 1


def case_bwd_deterministic(device: str) -> None:
    b = _b(device, seed=19, table_rows=[10], batch=16, max_len=30, hot=5, weighted=True)
    _, fused = kernels(device)
    grad_out = torch.randn(b.offsets.numel() - 1, 16, generator=torch.Generator().manual_seed(9))
    grad_out = grad_out.to(device)
    results = []
    for _ in range(2):
        w, s = b.weight.clone(), torch.zeros(b.weight.shape[0], device=device)
        fused(w, s, b.ids, b.offsets, grad_out, mode="mean", per_sample_weights=b.psw,
              lr=0.05, eps=1e-8)  # fmt: skip
        results.append((w, s))
    for k, what in enumerate(("weight", "state")):
        assert_same(
            results[0][k], results[1][k], what=f"{what}, two runs",
            why="the same kernels on the same inputs: a fixed order of the sums, no atomics",
        )  # fmt: skip


def case_random_batches(device: str) -> None:
    for seed in range(20, 24):
        g = torch.Generator().manual_seed(seed)
        n_tables = int(torch.randint(1, 4, (1,), generator=g))
        b = make_batch(
            seed=seed,
            table_rows=[int(torch.randint(1, 40, (1,), generator=g)) for _ in range(n_tables)],
            dim=int(torch.randint(1, 40, (1,), generator=g)),
            batch=int(torch.randint(1, 8, (1,), generator=g)),
            max_len=int(torch.randint(1, 25, (1,), generator=g)),
            weighted=bool(seed % 2),
            device=device,
            empty_frac=float(torch.rand(1, generator=g)) * 0.5,
        )
        mode = "mean" if seed % 3 == 0 else "sum"
        check_forward(b, mode, device)
        check_backward(b, mode, device)


# --- every ps optimizer, against its own apply on CPU ------------------------------------


def optimizers() -> dict[str, object]:
    """One config per kernel branch; large-ish rates and eps so each term is visible."""
    from ps.optimizers import FTRL, SGD, Adagrad, Adam, RowWiseAdagrad

    return {
        "sgd": SGD(lr=0.3),
        "sgd_momentum": SGD(lr=0.3, momentum=0.8),
        "rowwise_adagrad": RowWiseAdagrad(lr=0.4, eps=0.2),
        "adagrad": Adagrad(lr=0.4, eps=0.05),
        "adam": Adam(lr=0.05, betas=(0.8, 0.95), eps=1e-3),
        "adam_decay_beta1_zero": Adam(lr=0.05, betas=(0.0, 0.9), eps=1e-3, weight_decay=0.1),
        "ftrl": FTRL(alpha=0.5, beta=0.7, l1=0.05, l2=0.2),
    }


def random_state(opt: object, rows: int, dim: int, seed: int) -> torch.Tensor:
    """A non-trivial starting state ``[rows, S]`` (accumulators >= 0, Adam steps integral)."""
    from ps.optimizers import Adam

    s = opt.state_dim(dim)  # type: ignore[attr-defined]
    state = torch.rand(rows, s, generator=torch.Generator().manual_seed(seed))
    if isinstance(opt, Adam):
        state[:, :dim] -= 0.5  # m of either sign
        state[:, 2 * dim] = torch.randint(0, 4, (rows,), generator=torch.Generator())
    return state


def ps_step(
    b: Batch, state: torch.Tensor, grad_out: torch.Tensor, mode: str, opt: object
) -> tuple[torch.Tensor, torch.Tensor]:
    """The independent reference, on CPU: autograd row gradients of ``F.embedding_bag``,
    then ``opt.apply`` on the touched rows and their state, scattered back."""
    cpu = Batch(
        weight=b.weight.cpu(),
        ids=b.ids.cpu(),
        offsets=b.offsets.cpu(),
        psw=None if b.psw is None else b.psw.cpu(),
    )
    w = cpu.weight.clone().requires_grad_(True)
    (ref_pool(cpu, mode, w) * grad_out.cpu()).sum().backward()
    assert w.grad is not None
    new_w, new_s = cpu.weight.clone(), state.cpu().clone()
    touched = torch.unique(cpu.ids)  # [U]
    rows, st = new_w[touched].clone(), new_s[touched].clone()
    opt.apply(rows, st, w.grad[touched])  # type: ignore[attr-defined]
    new_w[touched], new_s[touched] = rows, st
    return new_w, new_s


def check_optimizer(b: Batch, opt: object, mode: str, device: str, *, steps: int) -> None:
    """``steps`` fused steps equal ``steps`` ps steps; untouched rows and state bitwise
    unchanged; clocks +1 per touched row per step."""
    from embedding.kernels.triton_optimizers import fused_backward_

    rows, dim = b.weight.shape
    g = torch.Generator().manual_seed(77)
    s0 = random_state(opt, rows, dim, seed=5)
    w, s = b.weight.clone(), s0.clone().to(device)
    w_ref, s_ref = b.weight.cpu(), s0.clone()
    w_ref64, s_ref64 = w_ref.double(), s0.double()
    clocks = torch.zeros(rows, dtype=torch.int64, device=device)
    for _ in range(steps):
        grad_out = torch.randn(b.offsets.numel() - 1, dim, generator=g)
        step_b = Batch(weight=w_ref, ids=b.ids, offsets=b.offsets, psw=b.psw)
        w_ref, s_ref = ps_step(step_b, s_ref, grad_out, mode, opt)
        step64 = f64(Batch(weight=w_ref64, ids=b.ids, offsets=b.offsets, psw=b.psw))
        w_ref64, s_ref64 = ps_step(step64, s_ref64, grad_out.double(), mode, opt)
        fused_backward_(
            w, s, b.ids, b.offsets, grad_out.to(device), opt,  # type: ignore[arg-type]
            mode=mode, per_sample_weights=b.psw, clocks=clocks,
        )  # fmt: skip
    occ = occurrences(b.ids)
    close_replayed(w, w_ref, w_ref, w_ref64, floor_terms=rows_terms(occ), what="weight")
    close_replayed(
        s, s_ref, s_ref, s_ref64, floor_terms=state_terms(occ, dim), what="state", slot=dim
    )
    untouched = torch.ones(rows, dtype=torch.bool)
    untouched[b.ids.cpu()] = False
    never = "the kernel never writes them"
    assert_same(w.cpu()[untouched], b.weight.cpu()[untouched], what="untouched rows", why=never)
    assert_same(s.cpu()[untouched], s0[untouched], what="untouched state", why=never)
    expect = torch.zeros(rows, dtype=torch.int64)
    expect[torch.unique(b.ids.cpu())] = steps
    assert torch.equal(clocks.cpu(), expect), "clocks must count one update per row per step"


def _check_each_optimizer(device: str, name: str) -> None:
    opt = optimizers()[name]
    # Weighted sum with hot rows (long runs, bags longer than a step) over two steps, then
    # a weighted mean with empty bags over two tables of an odd dim.
    hot = _b(device, seed=40, table_rows=[20], batch=6, max_len=24, hot=5, weighted=True)
    check_optimizer(hot, opt, "sum", device, steps=2)
    mixed = _b(device, seed=41, table_rows=[9, 14], dim=13, batch=5, weighted=True)
    check_optimizer(mixed, opt, "mean", device, steps=2)


def case_opt_sgd(device: str) -> None:
    _check_each_optimizer(device, "sgd")


def case_opt_sgd_momentum(device: str) -> None:
    _check_each_optimizer(device, "sgd_momentum")


def case_opt_rowwise_adagrad(device: str) -> None:
    _check_each_optimizer(device, "rowwise_adagrad")


def case_opt_adagrad(device: str) -> None:
    _check_each_optimizer(device, "adagrad")


def case_opt_adam(device: str) -> None:
    _check_each_optimizer(device, "adam")


def case_opt_adam_decay_beta1_zero(device: str) -> None:
    _check_each_optimizer(device, "adam_decay_beta1_zero")


def case_opt_ftrl(device: str) -> None:
    _check_each_optimizer(device, "ftrl")


def case_opt_rows_every_optimizer(device: str) -> None:
    # apply_rows_ (coalesced gradients, data parallel) equals ps's apply, for every optimizer,
    # at a dim wider than one column block for row-wise Adagrad (its two-pass path).
    from embedding.kernels.triton_optimizers import apply_rows_

    for i, (name, opt) in enumerate(optimizers().items()):
        dim = 150 if name == "rowwise_adagrad" else 19
        g = torch.Generator().manual_seed(50 + i)
        weight = torch.randn(30, dim, generator=g)
        rows = torch.randperm(30, generator=g)[:7]
        grads = torch.randn(7, dim, generator=g)
        s0 = random_state(opt, 30, dim, seed=i)
        w, s = weight.clone().to(device), s0.clone().to(device)
        clocks = torch.zeros(30, dtype=torch.int64, device=device)
        apply_rows_(w, s, rows.to(device), grads.to(device), opt, clocks=clocks)  # type: ignore[arg-type]
        w_ref, s_ref = weight[rows].clone(), s0[rows].clone()
        opt.apply(w_ref, s_ref, grads)  # type: ignore[attr-defined]
        w_ref64, s_ref64 = weight[rows].double(), s0[rows].double()
        opt.apply(w_ref64, s_ref64, grads.double())  # type: ignore[attr-defined]
        # One coalesced gradient per row: a single term, no sum.
        w_got, s_got = w.cpu()[rows], s.cpu()[rows]
        close_replayed(w_got, w_ref, w_ref, w_ref64, floor_terms=rows_terms(1), what=f"{name} rows")
        close_replayed(
            s_got, s_ref, s_ref, s_ref64, floor_terms=state_terms(1, dim), what=f"{name} state",
            slot=dim,
        )  # fmt: skip
        others = torch.ones(30, dtype=torch.bool)
        others[rows] = False
        assert_same(
            w.cpu()[others], weight[others], what=f"{name}: other rows",
            why="the kernel never writes them",
        )  # fmt: skip
        assert torch.equal(clocks.cpu(), (~others).long()), f"{name}: clocks"


#: Bags of :func:`case_opt_nonfinite_gradient_stays_in_its_row` (13 ids: one program of
#: ROWS = 16 sorted positions), and where its gradient is not finite: (bag, column, value).
NONFINITE_BAGS = [[3], [7], [11], [15], [15], [1, 2, 2], [4, 5], [2, 9], [5]]
NONFINITE_AT = [(0, 2, math.inf), (1, 5, -math.inf), (2, 0, math.nan),
                (3, 1, math.inf), (4, 1, -math.inf)]  # fmt: skip
NONFINITE_ROWS = [3, 7, 11, 15]  # rows 15: +Inf and -Inf from two bags, so NaN


def same_nonfinite(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """NaN, +Inf and -Inf at the same places in ``actual`` as in ``expected``."""
    for name, test in (("NaN", torch.isnan), ("+Inf", torch.isposinf), ("-Inf", torch.isneginf)):
        assert torch.equal(test(actual), test(expected)), (
            f"{what}: {name} at {test(actual).nonzero().tolist()}, "
            f"expected at {test(expected).nonzero().tolist()}"
        )


def case_opt_nonfinite_gradient_stays_in_its_row(device: str) -> None:
    # A +-Inf or NaN in grad_output reaches only the rows of its bag, as in the reference
    # (autograd of F.embedding_bag, then the optimizer's apply): the other rows of the same
    # program are the reference's, and bit for bit what the kernel gives when the
    # non-finite values are replaced by finite ones (the one-hot product must not turn
    # 0 x Inf into NaN in their lanes).
    from embedding.kernels.triton_optimizers import fused_backward_

    rows, dim = 20, 13
    g = torch.Generator().manual_seed(61)
    lengths = torch.tensor([len(b) for b in NONFINITE_BAGS])
    offsets = torch.zeros(len(NONFINITE_BAGS) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    ids = torch.tensor([i for b in NONFINITE_BAGS for i in b])
    weight = torch.randn(rows, dim, generator=g)
    psw = torch.rand(ids.numel(), generator=g) + 0.5
    grad_out = torch.randn(len(NONFINITE_BAGS), dim, generator=g)
    finite_out = grad_out.clone()
    for bag, col, value in NONFINITE_AT:
        grad_out[bag, col] = value
    bad = torch.zeros(rows, dtype=torch.bool)
    bad[NONFINITE_ROWS] = True
    touched = torch.zeros(rows, dtype=torch.bool)
    touched[ids] = True
    good = touched & ~bad
    for mode, weights in (("sum", psw), ("mean", None)):
        b = Batch(weight=weight, ids=ids, offsets=offsets, psw=weights)
        for i, (name, opt) in enumerate(optimizers().items()):
            what = f"{name} ({mode})"
            s0 = random_state(opt, rows, dim, seed=70 + i)
            runs = []
            for out in (grad_out, finite_out):
                w, s = weight.clone().to(device), s0.clone().to(device)
                clocks = torch.zeros(rows, dtype=torch.int64, device=device)
                fused_backward_(
                    w, s, ids.to(device), offsets.to(device), out.to(device), opt,  # type: ignore[arg-type]
                    mode=mode, per_sample_weights=None if weights is None else weights.to(device),
                    clocks=clocks,
                )  # fmt: skip
                runs.append((w.cpu(), s.cpu(), clocks.cpu()))
            (w, s, clocks), (w_fin, s_fin, _) = runs
            w_ref, s_ref = ps_step(b, s0, grad_out, mode, opt)
            w_ref64, s_ref64 = ps_step(f64(b), s0.double(), grad_out.double(), mode, opt)
            alone = "the lanes of the other rows never see a non-finite value"
            assert_same(w[good], w_fin[good], what=f"{what}: other rows", why=alone)
            assert_same(s[good], s_fin[good], what=f"{what}: other rows' state", why=alone)
            occ = occurrences(ids)
            close_replayed(w[good], w_ref[good], w_ref[good], w_ref64[good],
                           floor_terms=rows_terms(occ), what=f"{what}: other rows")  # fmt: skip
            close_replayed(s[good], s_ref[good], s_ref[good], s_ref64[good],
                           floor_terms=state_terms(occ, dim), what=f"{what}: other rows' state",
                           slot=dim)  # fmt: skip
            pairs = ((w, w_ref, w_ref64, "rows", rows_terms(occ)),
                     (s, s_ref, s_ref64, "state", state_terms(occ, dim)))  # fmt: skip
            for got, ref, ref64, part, terms in pairs:
                same_nonfinite(got[bad], ref[bad], f"{what}: non-finite {part}")
                same_nonfinite(ref64[bad], ref[bad], f"{what}: float64 replay of {part}")
                fin = torch.isfinite(ref[bad])
                close_replayed(got[bad][fin], ref[bad][fin], ref[bad][fin], ref64[bad][fin],
                               floor_terms=terms,
                               what=f"{what}: finite entries of non-finite {part}")  # fmt: skip
            never = "the kernel never writes them"
            assert_same(w[~touched], weight[~touched], what=f"{what}: untouched rows", why=never)
            assert_same(s[~touched], s0[~touched], what=f"{what}: untouched state", why=never)
            assert torch.equal(clocks, touched.long()), f"{what}: clocks"


def case_opt_deterministic(device: str) -> None:
    # Two runs of the same Adam step (long runs of hot rows) are bitwise equal.
    from embedding.kernels.triton_optimizers import fused_backward_

    opt = optimizers()["adam"]
    b = _b(device, seed=42, table_rows=[8], batch=12, max_len=30, hot=4, weighted=True)
    grad_out = torch.randn(b.offsets.numel() - 1, 16, generator=torch.Generator().manual_seed(2))
    results = []
    for _ in range(2):
        w, s = b.weight.clone(), random_state(opt, 8, 16, seed=3).to(device)
        fused_backward_(w, s, b.ids, b.offsets, grad_out.to(device), opt,  # type: ignore[arg-type]
                        mode="mean", per_sample_weights=b.psw)  # fmt: skip
        results.append((w, s))
    for k, what in enumerate(("weight", "state")):
        assert_same(
            results[0][k], results[1][k], what=f"adam {what}, two runs",
            why="the same kernels on the same inputs: a fixed order of the sums, no atomics",
        )  # fmt: skip


FUSED_ROWS, FUSED_DIM, FUSED_BAGS = 60, 24, 40


def fused_lookup_draws(
    opt_name: str, steps: int
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, ...]]]:
    """The initial weight and state of :func:`fused_lookup_steps` and, per step, its
    weighted bags (hot, repeated ids) and the loss's targets: ``(ids, offsets, psw, target)``."""
    opt = optimizers()[opt_name]
    g = torch.Generator().manual_seed(11)
    rows, dim, bags = FUSED_ROWS, FUSED_DIM, FUSED_BAGS
    weight = torch.randn(rows, dim, generator=g)
    state = random_state(opt, rows, dim, seed=12)
    draws = []
    for _ in range(steps):
        lengths = torch.randint(0, 6, (bags,), generator=g)
        ids = torch.randint(0, 12, (int(lengths.sum()),), generator=g) * 5  # hot, repeated
        offsets = torch.zeros(bags + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(lengths, 0)
        psw = torch.rand(ids.numel(), generator=g)
        target = torch.randn(bags, dim, generator=g)
        draws.append((ids, offsets, psw, target))
    return weight, state, draws


def fused_lookup_steps(device: str, opt_name: str, steps: int) -> tuple[torch.Tensor, ...]:
    """``steps`` training steps of one fused group (weighted bags, hot repeated ids) through
    ``embedding.fused_ops.FusedLookupFunction`` on ``device``: (weight, state, clocks) on CPU."""
    from comm.local import LocalGroup
    from embedding.fused_ops import FusedGroup, FusedLookupFunction, GroupBatch

    opt = optimizers()[opt_name]
    weight, state, draws = fused_lookup_draws(opt_name, steps)
    group = FusedGroup(
        dim=FUSED_DIM,
        optimizer=opt,  # type: ignore[arg-type]
        weight=weight.to(device),
        state=state.to(device),
        clocks=torch.zeros(FUSED_ROWS, dtype=torch.int64, device=device),
    )
    anchor = torch.zeros(0, requires_grad=True)
    for ids, offsets, psw, target in draws:
        batch = GroupBatch(ids.to(device), offsets.to(device), psw.to(device))
        (out,) = FusedLookupFunction.apply(anchor, [group], [batch], LocalGroup(), [[FUSED_BAGS]])
        (out * target.to(device)).sum().backward()
    return group.weight.cpu(), group.state.cpu(), group.clocks.cpu()


def fused_lookup_reference(
    opt_name: str, steps: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """:func:`fused_lookup_steps` by :func:`ps_step` (weighted-sum ``F.embedding_bag``, then
    the optimizer's ``apply``) on CPU in ``dtype``: (weight, state, the most occurrences of
    one id in a step)."""
    opt = optimizers()[opt_name]
    weight, state, draws = fused_lookup_draws(opt_name, steps)
    w, s, occ = weight.to(dtype), state.to(dtype), 0
    for ids, offsets, psw, target in draws:
        b = Batch(weight=w, ids=ids, offsets=offsets, psw=psw.to(dtype))
        w, s = ps_step(b, s, target.to(dtype), "sum", opt)
        occ = max(occ, occurrences(ids))
    return w, s, occ


def check_fused_runs_agree(
    actual: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...], opt_name: str, steps: int
) -> None:
    """Two runs of :func:`fused_lookup_steps` (other kernels, other summation orders) agree
    within the replay tolerance of :func:`fused_lookup_reference`; clocks exactly."""
    w32, s32, occ = fused_lookup_reference(opt_name, steps, torch.float32)
    w64, s64, _ = fused_lookup_reference(opt_name, steps, torch.float64)
    (w, s, clocks), (w_e, s_e, clocks_e) = actual, expected
    for t, e in ((w, w_e), (s, s_e)):
        assert t.dtype == e.dtype and t.shape == e.shape, (opt_name, t.shape, e.shape)
    close_replayed(w, w_e, w32, w64, floor_terms=rows_terms(occ), what=f"{opt_name} weight")
    close_replayed(
        s, s_e, s32, s64, floor_terms=state_terms(occ, FUSED_DIM), what=f"{opt_name} state",
        slot=FUSED_DIM,
    )  # fmt: skip
    assert_same(clocks, clocks_e, what=f"{opt_name} clocks", why="integer update counts")


def case_fused_ops_dispatch(device: str) -> None:
    # embedding.fused_ops hands every optimizer to the Triton backward on CUDA; here the
    # dispatch is forced on CPU tensors (interpreter) and 2 steps compared with the CPU path
    # it replaces (the C kernel for row-wise Adagrad, the ps optimizer's apply otherwise).
    import embedding.fused_ops as fused_ops

    for name in optimizers():
        expected = fused_lookup_steps(device, name, 2)
        saved = fused_ops._use_triton_update, fused_ops._cpu_rowwise_adagrad_parts
        fused_ops._use_triton_update = lambda g: True  # type: ignore[assignment]
        fused_ops._cpu_rowwise_adagrad_parts = lambda *a: False  # type: ignore[assignment]
        try:
            actual = fused_lookup_steps(device, name, 2)
        finally:
            fused_ops._use_triton_update, fused_ops._cpu_rowwise_adagrad_parts = saved
        check_fused_runs_agree(actual, expected, name, 2)


def case_fwd_every_config(device: str) -> None:
    # Every config the GPU autotuner may pick gives the same pooling (sum and weighted mean,
    # empty bags, bags longer than BLOCK_N, a partial last tile of bags, odd D).
    import triton

    from embedding.kernels._checks import block_d
    from embedding.kernels.triton_pool import FWD_CONFIGS, MAX_BLOCK_D, _pool_kernel

    b = _b(device, seed=43, table_rows=[30], dim=13, batch=7, max_len=20, weighted=True)
    bd = block_d(13, MAX_BLOCK_D)
    nb = b.offsets.numel() - 1
    for cfg in FWD_CONFIGS:
        for mode, psw in (("sum", None), ("mean", b.psw)):
            out = torch.empty(nb, 13, device=device)
            grid = (triton.cdiv(nb, cfg.kwargs["BAGS"]), 1)
            _pool_kernel[grid](
                b.weight, b.weight.stride(0), b.ids, b.offsets, b.ids if psw is None else psw,
                out, nb, 13, 4, HAS_WEIGHTS=psw is not None, MEAN=mode == "mean",
                WIDE_INDEX=False, BLOCK_D=bd, num_warps=cfg.num_warps, **cfg.kwargs,
            )  # fmt: skip
            cb = Batch(weight=b.weight, ids=b.ids, offsets=b.offsets, psw=psw)
            close_pool(out, cb, mode, what=f"pooled by config {cfg}")


def case_probe_kernel(device: str) -> None:
    # The trivial kernel embedding.kernels.triton_builds launches before the real ones.
    from embedding.kernels._probe import run_probe

    run_probe(torch.device(device))


def case_bad_input(device: str) -> None:
    from embedding.kernels.triton_optimizers import apply_rows_, fused_backward_
    from ps.optimizers import SGD, Adam

    pooled_lookup, fused = kernels(device)
    b = _b(device, seed=30)
    w, ids, off = b.weight, b.ids, b.offsets
    n, rows = ids.numel(), w.shape[0]
    bad: list[tuple[str, Callable[[], object], type[Exception], str]] = [
        ("mode", lambda: pooled_lookup(w, ids, off, mode="max"), ValueError, "'max'"),
        ("float ids", lambda: pooled_lookup(w, ids.float(), off, mode="sum"), TypeError, "ids"),
        ("1-D weight", lambda: pooled_lookup(w[0], ids, off, mode="sum"), TypeError, "weight"),
        (
            "offsets end",
            lambda: pooled_lookup(w, ids[:-1], off, mode="sum"),
            ValueError,
            f"len(ids) = {n - 1}",
        ),
        (
            "id out of range",
            lambda: pooled_lookup(w, ids + rows, off, mode="sum"),
            ValueError,
            f"[0, {rows})",
        ),
        (
            "psw shape",
            lambda: pooled_lookup(w, ids, off, mode="sum", per_sample_weights=ids[:1].float()),
            ValueError,
            "per_sample_weights",
        ),
        (
            "state size",
            lambda: fused(
                w.clone(),
                torch.zeros(rows - 1, device=device),
                ids,
                off,
                torch.zeros(off.numel() - 1, w.shape[1], device=device),
                mode="sum",
                per_sample_weights=None,
                lr=0.1,
                eps=1e-8,
            ),  # fmt: skip
            ValueError,
            f"[{rows}, 1]",
        ),
        (
            "adam state width",
            lambda: fused_backward_(
                w.clone(),
                torch.zeros(rows, w.shape[1], device=device),
                ids,
                off,
                torch.zeros(off.numel() - 1, w.shape[1], device=device),
                Adam(lr=0.1),
                mode="sum",
                per_sample_weights=None,
            ),  # fmt: skip
            ValueError,
            f"[{rows}, {2 * w.shape[1] + 1}] (adam",
        ),
        (
            "not an optimizer",
            lambda: apply_rows_(w.clone(), torch.zeros(rows, device=device), ids[:1], w[:1], "sgd"),  # type: ignore[arg-type]  # fmt: skip
            TypeError,
            "ps Optimizer",
        ),
        (
            "rows dtype",
            lambda: apply_rows_(
                w.clone(), torch.zeros(rows, 0, device=device), ids[:1].float(), w[:1], SGD(lr=0.1)
            ),  # fmt: skip
            TypeError,
            "rows",
        ),
        (
            "grad shape",
            lambda: fused(
                w.clone(),
                torch.zeros(rows, device=device),
                ids,
                off,
                torch.zeros(off.numel(), w.shape[1], device=device),
                mode="sum",
                per_sample_weights=None,
                lr=0.1,
                eps=1e-8,
            ),  # fmt: skip
            ValueError,
            "grad_output",
        ),
    ]
    for what, call, exc, needle in bad:
        try:
            call()
        except exc as e:
            assert needle in str(e), f"{what}: message {str(e)!r} lacks {needle!r}"
        else:
            raise AssertionError(f"{what}: no {exc.__name__} raised")


# --- ahead-of-time compile for a real GPU target (no GPU needed) ------------------------

POOL_SIG = {
    "weight_ptr": "*fp32",
    "stride_w": "i32",
    "ids_ptr": "*i64",
    "offsets_ptr": "*i64",
    "psw_ptr": "*fp32",
    "out_ptr": "*fp32",
    "num_bags": "i32",
    "D": "i32",
    "pooling": "i32",
}
OCCURRENCE_SIG = {
    "offsets_ptr": "*i64",
    "psw_ptr": "*fp32",
    "bag_ptr": "*i32",
    "scale_ptr": "*fp32",
    "num_bags": "i32",
}
UPDATE_SIG = {
    "weight_ptr": "*fp32",
    "stride_w": "i32",
    "state_ptr": "*fp32",
    "stride_s": "i32",
    "clocks_ptr": "*i64",
    "hyper_ptr": "*fp64",
    "sorted_ptr": "*i32",
    "run_end_ptr": "*i32",
    "order_ptr": "*i64",
    "bag_ptr": "*i32",
    "scale_ptr": "*fp32",
    "grad_ptr": "*fp32",
    "stride_g": "i32",
    "n": "i32",
    "D": "i32",
    "keys_ptr": "*i64",
    "row_ids_ptr": "*i64",
}


def _update_variant(opt: int, **kw: object) -> tuple[str, dict[str, str], dict[str, object]]:
    cx: dict[str, object] = {
        "OPT": opt, "FROM_RUNS": True, "HAS_SCALE": True, "HAS_CLOCKS": True,
        "NUM_D_BLOCKS": 1, "ROWS": 16, "BLOCK_N": 32, "BLOCK_D": 64, "ROUND": 0,
        "HAS_ROW_IDS": False,
    }  # fmt: skip
    return ("update", {}, cx | kw)


#: (kernel, signature overrides, constexprs): together they reach every branch.
COMPILE_VARIANTS: dict[str, tuple[str, dict[str, str], dict[str, object]]] = {
    "pool_weighted_mean_tile": (
        "pool",
        {},
        {
            "HAS_WEIGHTS": True,
            "MEAN": True,
            "WIDE_INDEX": False,
            "BAGS": 4,
            "BLOCK_N": 8,
            "BLOCK_D": 64,
        },
    ),  # fmt: skip
    "pool_sum_bf16_int32_wide": (
        "pool",
        {
            "weight_ptr": "*bf16",
            "out_ptr": "*bf16",
            "ids_ptr": "*i32",
            "offsets_ptr": "*i32",
            "stride_w": "i64",
        },
        {
            "HAS_WEIGHTS": False,
            "MEAN": False,
            "WIDE_INDEX": True,
            "BAGS": 32,
            "BLOCK_N": 1,
            "BLOCK_D": 16,
        },
    ),  # fmt: skip
    "occurrence_weighted_mean": (
        "occurrence",
        {},
        {"HAS_WEIGHTS": True, "MEAN": True, "BAGS": 64, "BLOCK_N": 8},
    ),
    "update_sgd": _update_variant(0),
    "update_momentum": _update_variant(1),
    "update_rowwise_adagrad": _update_variant(2),
    "update_adagrad": _update_variant(3),
    "update_adam": _update_variant(4),
    "update_ftrl": _update_variant(5),
    "update_adam_wide_two_blocks": _update_variant(4, NUM_D_BLOCKS=2, BLOCK_N=16, BLOCK_D=128),
    # fp16 / bf16 rows: stochastic rounding (ROUND 1 fp16, 2 bf16) on the uint64 hash.
    "update_rowwise_adagrad_fp16": (
        "update",
        {"weight_ptr": "*fp16"},
        _update_variant(2, ROUND=1)[2],
    ),
    "update_ftrl_bf16_row_ids": (
        "update",
        {"weight_ptr": "*bf16"},
        _update_variant(5, ROUND=2, HAS_ROW_IDS=True)[2],
    ),  # fmt: skip
    "pool_fp16_to_fp32": (
        "pool",
        {"weight_ptr": "*fp16"},
        {
            "HAS_WEIGHTS": True,
            "MEAN": False,
            "WIDE_INDEX": False,
            "BAGS": 32,
            "BLOCK_N": 1,
            "BLOCK_D": 64,
        },
    ),  # fmt: skip
    "update_rowwise_rows_two_blocks": _update_variant(
        2,
        FROM_RUNS=False,
        HAS_SCALE=False,
        HAS_CLOCKS=False,
        NUM_D_BLOCKS=2,
        ROWS=16,
        BLOCK_N=1,
        BLOCK_D=256,
    ),  # fmt: skip
}


def compile_variant(name: str, arch: int) -> None:
    """Compile one kernel variant down to a cubin for ``sm_<arch>`` with the bundled ptxas.

    The interpreter runs kernels through numpy and so misses what only the real
    compiler rejects (types, shapes, unsupported ops); this catches those without a GPU.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    from embedding.kernels.triton_optimizers import _occurrence_kernel, _update_kernel
    from embedding.kernels.triton_pool import _pool_kernel

    kernel, overrides, constexprs = COMPILE_VARIANTS[name]
    fn, sig = {
        "pool": (_pool_kernel, POOL_SIG),
        "occurrence": (_occurrence_kernel, OCCURRENCE_SIG),
        "update": (_update_kernel, UPDATE_SIG),
    }[kernel]
    signature = {**sig, **overrides, **{k: "constexpr" for k in constexprs}}
    src = ASTSource(fn, signature, constexprs=constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32))
    assert compiled.asm.get("cubin"), f"{name}: no cubin produced"


def _compile_case(name: str, arch: int, _device: str) -> None:
    compile_variant(name, arch)


CASES: dict[str, Callable[[str], None]] = {
    name[len("case_") :]: fn for name, fn in sorted(globals().items()) if name.startswith("case_")
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--compile-arch",
        type=int,
        default=0,
        help="instead of running cases, compile every kernel variant for sm_<ARCH> (e.g. 90); "
        "needs TRITON_INTERPRET unset",
    )
    parser.add_argument(
        "--shard",
        default="0/1",
        help="I/K: run the I-th of K shares of the cases (balanced by SHARD_WEIGHTS), so K "
        "processes compile their kernels in parallel; only share 0 prints the import check",
    )
    parser.add_argument("cases", nargs="*", help="case names (default: all)")
    args = parser.parse_args(argv)
    try:
        index, shards = (int(x) for x in args.shard.split("/"))
        if not 0 <= index < shards:
            raise ValueError
    except ValueError:
        parser.error(f"--shard must be I/K with 0 <= I < K, got {args.shard!r}")
    if args.compile_arch:
        if os.environ.get("TRITON_INTERPRET", "0") == "1":
            parser.error("--compile-arch needs TRITON_INTERPRET unset (it compiles for real)")
        arch = args.compile_arch
        variants = {
            f"compile_sm{arch}_{n}": functools.partial(_compile_case, n, arch)
            for n in COMPILE_VARIANTS
        }
        return run_all(variants, args.device)
    import_check = kernels_import_without_triton()
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules define their kernels
    elif not torch.cuda.is_available():
        print(json.dumps({"case": "*", "ok": False, "error": "--device cuda: no CUDA device"}))
        return 1
    # fwd_every_config launches every config the autotuner may pick, so the other cases
    # take the fixed one: tuning would compile up to 8 configs for each of their 17 launch
    # keys (~136 compiles) to check what that case already checks.
    os.environ.setdefault("HYBRIDREC_TRITON_AUTOTUNE", "0")
    names = args.cases or list(CASES)
    selected = {n: CASES[n] for n in shard(names, index, shards)}
    if index == 0:
        print(json.dumps(import_check), flush=True)
    return max(run_all(selected, args.device), int(not import_check["ok"]))


#: Kernel compiles a case triggers on a cold cache, in update-kernel compiles (~3 s each on
#: one core; a forward compile is ~0.7 s), counted with the interpreter; cases not named
#: compile about one. Only balances ``--shard``.
SHARD_WEIGHTS = {
    "fused_ops_dispatch": 6,
    "opt_nonfinite_gradient_stays_in_its_row": 6,
    "opt_rows_every_optimizer": 6,
    "random_batches": 5,
    "fwd_every_config": 4,
    **{f"opt_{name}": 2 for name in ("sgd", "sgd_momentum", "rowwise_adagrad", "adagrad",
                                     "adam", "adam_decay_beta1_zero", "ftrl")},
}  # fmt: skip


def shard(names: list[str], index: int, shards: int) -> list[str]:
    """The ``index``-th of ``shards`` shares of ``names``: heaviest first, each to the
    lightest share so far (by :data:`SHARD_WEIGHTS`); in the given order within a share."""
    load = [0.0] * shards
    owner: dict[str, int] = {}
    for name in sorted(names, key=lambda n: (-SHARD_WEIGHTS.get(n, 1), n)):
        k = load.index(min(load))
        owner[name] = k
        load[k] += SHARD_WEIGHTS.get(name, 1)
    return [n for n in names if owner[n] == index]


IMPORT_CHECK = "kernels_package_does_not_import_triton"


def kernels_import_without_triton() -> dict[str, object]:
    """The ``IMPORT_CHECK`` line: importing ``embedding.kernels`` (first thing in this
    process, before any case) must not import triton, so the torch fallback works where
    triton is absent; only the kernel modules import it."""
    import embedding.kernels  # noqa: F401

    eager = "triton" in sys.modules
    error = "importing embedding.kernels imported triton (eagerly)" if eager else ""
    return {"case": IMPORT_CHECK, "ok": not eager, "error": error}


def run_all(cases: Mapping[str, Callable[[str], None]], device: str) -> int:
    """Run each case, print one JSON line per case; 1 if any failed."""
    failed = 0
    for name, fn in cases.items():
        try:
            fn(device)
            ok, err = True, ""
        except Exception:
            ok, err = False, traceback.format_exc(limit=4)
        failed += not ok
        print(json.dumps({"case": name, "ok": ok, "error": err}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
