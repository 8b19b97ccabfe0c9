"""Counted pushes through any store that takes them, against the in-process store.

:func:`check_counted_pushes` runs the same pushes (counted ones with counts from 1 to 5
and their statistics, mixed with plain ones, repeated ids among them) on ``store`` and
on an ``InProcessStore``, for every optimizer on a fixed and a dynamic table, and
requires the same rows, state and clocks bit for bit: both apply each row's update with
the same code (``ps.local.table.LocalTable``), whatever the shards. Used by the MPI
rank scripts (under ``mpirun``) and the tests of the other stores."""

from __future__ import annotations

import torch

import ps

try:
    from tolerance import assert_same
except ModuleNotFoundError:
    from tests.support.tolerance import assert_same

DIM = 6
OPTIMIZERS = (
    ps.SGD(lr=0.1),
    ps.SGD(lr=0.1, momentum=0.9),
    ps.RowWiseAdagrad(lr=0.1),
    ps.Adagrad(lr=0.1),
    ps.Adam(lr=0.01, weight_decay=0.01),
    ps.FTRL(alpha=0.1, l1=0.01),
)
WHY = "the same pushes applied per row by the same code (LocalTable) on both stores"


def _pushes(opt: ps.Optimizer, rows: int, seed: int) -> list[ps.PushRequest]:
    gen = torch.Generator().manual_seed(seed)
    q = opt.stat_dim(DIM)
    out = []
    for step in range(6):
        ids = torch.randint(0, rows, (40,), generator=gen)  # repeats
        grads = torch.randn(40, DIM, generator=gen)
        if step % 3 == 2:  # a plain push between the counted ones
            out.append(ps.PushRequest("", ids, grads))
            continue
        counts = torch.randint(1, 6, (40,), generator=gen)
        stats = torch.rand(40, q, generator=gen) * counts.unsqueeze(1)
        out.append(ps.PushRequest("", ids, grads, counts, stats))
    return out


def check_counted_pushes(store: ps.Store, prefix: str) -> int:
    """See the module docstring; returns the tables compared (its own, named ``prefix``...)."""
    n = 0
    for k, opt in enumerate(OPTIMIZERS):
        for rows in (50, None):
            name = f"{prefix}{k}{'f' if rows else 'd'}"
            spec = ps.TableSpec(name=name, num_rows=rows, dim=DIM, optimizer=opt)
            ref = ps.InProcessStore()
            for s in (store, ref):
                s.create_table(spec)
            for r in _pushes(opt, 50, seed=k):
                req = ps.PushRequest(name, r.ids, r.grads, r.counts, r.stats)
                store.push_many([req])
                ref.push_many([req])
            every = torch.arange(50)
            got, want = store.pull(name, every), ref.pull(name, every)
            assert_same(got.rows, want.rows, what=f"{name} rows", why=WHY)
            assert_same(store.state(name, every), ref.state(name, every), what=f"{name} state",
                        why=WHY)  # fmt: skip
            assert torch.equal(got.clocks, want.clocks), name
            n += 1
    return n
