"""Request checks shared by every store.

They run before a store changes anything, so a bad request leaves the table as it
was, and every store reports the same mistake with the same words (table name,
offending value, what was expected).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import torch

from comm import boundary
from ps.table import TableSpec


def unknown_table(name: object, known: Iterable[str]) -> ValueError:
    names = sorted(known)
    return ValueError(f"unknown table {name!r}; known tables: {names}")


def check_ids(spec: TableSpec, ids: object, op: str) -> torch.Tensor:
    """``ids`` must be a 1-D int64 tensor; of a fixed table, in ``[0, num_rows)``; returns it."""
    ids = check_id_tensor(spec, ids, op)
    if ids.numel() > 0 and spec.num_rows is not None:
        lo, hi = torch.aminmax(ids)  # two scalars: cheaper than a [N] bool mask on the good path
        if int(lo) < 0 or int(hi) >= spec.num_rows:
            pos = int(torch.nonzero((ids < 0) | (ids >= spec.num_rows))[0, 0])
            raise ValueError(
                f"{op} table {spec.name!r}: id {int(ids[pos])} at position {pos} is out of "
                f"range; valid ids are [0, {spec.num_rows})"
            )
    return ids


def check_id_tensor(spec: TableSpec, ids: object, op: str) -> torch.Tensor:
    """:func:`check_ids` without the range check (a caller checking the range of several
    tables' ids at once): ``ids`` must be a 1-D int64 tensor; returns it."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(
            f"{op} table {spec.name!r}: ids must be a torch.Tensor of int64, "
            f"got {type(ids).__name__}"
        )
    if ids.dtype != torch.int64:
        raise TypeError(f"{op} table {spec.name!r}: ids must be int64, got {ids.dtype}")
    if ids.dim() != 1:
        raise ValueError(f"{op} table {spec.name!r}: ids must be 1-D, got shape {tuple(ids.shape)}")
    return ids


def check_pull_bound(
    spec: TableSpec, ids: torch.Tensor, clocks: object, bound: object
) -> torch.Tensor | None:
    """A conditional pull needs both ``clocks`` (int64 ``[len(ids)]``) and ``bound`` (int >= 0).

    Returns ``clocks`` (on the CPU), or None for a plain pull (both None).
    """
    if clocks is None and bound is None:
        return None
    if clocks is None or bound is None:
        raise ValueError(
            f"pull table {spec.name!r}: a conditional pull needs both clocks and bound, "
            f"got clocks={'None' if clocks is None else 'a tensor'} and bound={bound!r}"
        )
    if not isinstance(bound, int) or isinstance(bound, bool) or bound < 0:
        raise ValueError(f"pull table {spec.name!r}: bound must be an int >= 0, got {bound!r}")
    if not isinstance(clocks, torch.Tensor):
        raise TypeError(
            f"pull table {spec.name!r}: clocks must be a torch.Tensor of int64, "
            f"got {type(clocks).__name__}"
        )
    if clocks.dtype != torch.int64:
        raise TypeError(f"pull table {spec.name!r}: clocks must be int64, got {clocks.dtype}")
    if tuple(clocks.shape) != tuple(ids.shape):
        raise ValueError(
            f"pull table {spec.name!r}: clocks have shape {tuple(clocks.shape)}, expected "
            f"{tuple(ids.shape)} (one per id)"
        )
    return clocks.cpu()


def all_finite(x: torch.Tensor) -> bool:
    """Whether every value of ``x`` is finite: on host float32 the sum first (a NaN or
    an infinity makes it NaN or infinite, so a finite sum settles it; torch sums on every
    intra-op thread, ~2.5x cheaper than numpy's element test at two), numpy's test only
    when the sum is not finite (a NaN, or finite values that overflow); one reduction and
    one sync on a device (read through :func:`comm.boundary.read`). The stores' gradients
    are host tensors; a cache on a device checks its own in one read for every table
    (``cache.CachedStore``)."""
    if x.is_cpu and x.dtype == torch.float32 and not x.requires_grad:
        if math.isfinite(float(x.sum())):
            return True
        return bool(np.isfinite(x.numpy()).all())
    verdict = torch.isfinite(x).all()
    return bool(verdict) if x.is_cpu else bool(boundary.read(verdict))


def finite_rows(x: torch.Tensor) -> torch.Tensor:
    """Which rows of ``x`` ``[N, D]`` hold only finite values: bool ``[N]``.

    A row with NaN/Inf has a non-finite sum, so the row sums (cheap) settle every
    row whose sum is finite; only rows whose sum is not (NaN/Inf, or an overflow
    of huge finite values) get the exact element-wise test (``torch.isfinite``
    over the whole ``[N, D]`` is several times slower than a sum). On a device: the
    exact test at once, so nothing is read back.
    """
    if not x.is_cpu:  # the exact test, without reading anything back
        return torch.isfinite(x).all(dim=1)
    plain = not x.requires_grad and x.dtype == torch.float32
    if plain and all_finite(x):  # the common case, ~4x cheaper
        return torch.ones(x.shape[0], dtype=torch.bool)
    ok = torch.isfinite(x.sum(dim=1))  # [N]
    if not bool(ok.all()):
        suspects = torch.nonzero(~ok).squeeze(1)
        ok[suspects] = torch.isfinite(x[suspects]).all(dim=1)
    return ok


def check_grads(
    spec: TableSpec, ids: torch.Tensor, grads: object, *, finite: bool = True
) -> torch.Tensor:
    """``grads`` must be float32 ``[len(ids), dim]`` (and finite, if ``finite``); returns it.

    Stores pass ``finite=False`` for a ``nan_policy="skip"`` table and drop the
    non-finite rows themselves.
    """
    if not isinstance(grads, torch.Tensor):
        raise TypeError(
            f"push table {spec.name!r}: grads must be a torch.Tensor of float32, "
            f"got {type(grads).__name__}"
        )
    if grads.dtype != torch.float32:
        raise TypeError(f"push table {spec.name!r}: grads must be float32, got {grads.dtype}")
    expected = (int(ids.shape[0]), spec.dim)
    if tuple(grads.shape) != expected:
        raise ValueError(
            f"push table {spec.name!r}: grads have shape {tuple(grads.shape)}, "
            f"expected {expected} (len(ids), dim)"
        )
    if finite and grads.numel() > 0:
        ok = finite_rows(grads)  # [N]
        if not (bool(ok.all()) if ok.is_cpu else boundary.read(ok.all())):
            pos = int(torch.nonzero(~ok)[0, 0])
            raise ValueError(
                f"push table {spec.name!r}: gradient of row id {int(ids[pos])} (position "
                f"{pos}) contains NaN or Inf; nothing was applied (set the table's "
                f"nan_policy='skip' to drop such rows instead)"
            )
    return grads


def check_counted(
    spec: TableSpec, ids: torch.Tensor, counts: object, stats: object, *, takes: bool, where: str
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A push's ``counts`` int64 ``[N]`` (>= 1) and ``stats`` float32 ``[N, Q]`` (``Q`` =
    the optimizer's ``stat_dim``; finite, >= 0), or None for a push that is not counted
    or is the same as a plain push (:func:`plain_counted`: its statistics, which the
    store then does not use, are checked for dtype and shape only). ``takes``: whether
    the store (named ``where``) takes counted pushes."""
    if counts is None and stats is None:
        return None
    what = f"push table {spec.name!r}"
    if not takes:
        raise ValueError(f"{what}: {where} does not take counted pushes (counts, stats)")
    n, q = int(ids.shape[0]), spec.optimizer.stat_dim(spec.dim)
    if not isinstance(counts, torch.Tensor) or counts.dtype != torch.int64:
        got = counts.dtype if isinstance(counts, torch.Tensor) else type(counts).__name__
        raise TypeError(f"{what}: counts must be an int64 tensor, got {got}")
    if tuple(counts.shape) != (n,):
        raise ValueError(f"{what}: counts have shape {tuple(counts.shape)}, expected ({n},)")
    counts = counts.detach().cpu()
    if n and int(counts.min()) < 1:
        pos = int(torch.nonzero(counts < 1)[0, 0])
        raise ValueError(
            f"{what}: count {int(counts[pos])} for row id {int(ids[pos])}; counts are >= 1"
        )
    if not isinstance(stats, torch.Tensor) or stats.dtype != torch.float32:
        got = stats.dtype if isinstance(stats, torch.Tensor) else type(stats).__name__
        raise TypeError(f"{what}: stats must be a float32 tensor, got {got}")
    if tuple(stats.shape) != (n, q):
        raise ValueError(
            f"{what}: stats have shape {tuple(stats.shape)}, expected ({n}, {q}) "
            f"(len(ids), the stat_dim of {spec.optimizer.name})"
        )
    if plain_counted(spec, ids, counts):
        return None  # its statistics are not used: their values need no check
    stats = stats.detach().cpu()
    if stats.numel():
        # Two reductions, no [N, Q] temporaries: a NaN makes both comparisons fail.
        values = stats.numpy()
        if not (float(values.min()) >= 0 and float(values.max()) < math.inf):
            raise ValueError(f"{what}: stats must be finite and >= 0 (sums of squares)")
    return counts, stats


def plain_counted(spec: TableSpec, ids: torch.Tensor, counts: torch.Tensor) -> bool:
    """Whether a counted push of ``ids`` ``[N]`` with ``counts`` ``[N]`` is a plain one:
    the optimizer sums exactly (plain SGD), or every row is one update and no id repeats
    (ids strictly increasing: a repeated id's counts would add up)."""
    if spec.optimizer.sums_exactly():
        return True
    a = ids.detach().cpu().numpy()
    distinct = a.size < 2 or bool((a[1:] > a[:-1]).all())
    return distinct and bool((counts == 1).all())


def check_write(spec: TableSpec, ids: object, rows: object, state: object, clocks: object) -> None:
    """A write (:class:`ps.WriteRequest`) of ``spec``'s table: distinct ``ids`` in range of a
    fixed float32 table, finite ``rows`` float32 ``[N, D]`` and ``state`` float32 ``[N,
    S]``, ``clocks`` int64 ``[N]`` >= 0; raises naming the table and the value."""
    what = f"write table {spec.name!r}"
    if spec.num_rows is None or spec.narrow:
        kind = "a dynamic table" if spec.num_rows is None else f"a {spec.dtype} table"
        raise ValueError(f"{what}: writes take fixed float32 tables, got {kind}")
    ids = check_ids(spec, ids, "write")
    n, s = int(ids.shape[0]), spec.state_dim
    a = ids.cpu().numpy()
    increasing = a.size < 2 or bool((a[1:] > a[:-1]).all())  # what a cache sends
    if not increasing and np.unique(a).size != a.size:
        raise ValueError(f"{what}: ids must be distinct (a write sets each row once)")
    for name, x, dtype, shape in (
        ("rows", rows, torch.float32, (n, spec.dim)),
        ("state", state, torch.float32, (n, s)),
        ("clocks", clocks, torch.int64, (n,)),
    ):
        if not isinstance(x, torch.Tensor) or x.dtype != dtype:
            got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
            raise TypeError(f"{what}: {name} must be a {dtype} tensor, got {got}")
        if tuple(x.shape) != shape:
            raise ValueError(f"{what}: {name} have shape {tuple(x.shape)}, expected {shape}")
        if x.device.type != "cpu":
            raise ValueError(f"{what}: {name} must be on the host, got {x.device}")
    assert isinstance(rows, torch.Tensor) and isinstance(state, torch.Tensor)
    assert isinstance(clocks, torch.Tensor)
    for name, x in (("rows", rows), ("state", state)):
        if x.numel() and not all_finite(x):
            pos = int(torch.nonzero(~torch.isfinite(x).all(dim=1))[0, 0])
            raise ValueError(
                f"{what}: {name} of row id {int(a[pos])} (position {pos}) contain NaN or Inf; "
                "nothing was written"
            )
    if n and int(clocks.min()) < 0:
        pos = int(torch.nonzero(clocks < 0)[0, 0])
        raise ValueError(
            f"{what}: clock {int(clocks[pos])} for row id {int(a[pos])}; clocks are >= 0"
        )
