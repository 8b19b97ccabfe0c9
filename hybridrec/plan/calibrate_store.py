"""The PS shard's part of the calibration: one shard's work (:class:`ps.InProcessStore`,
the engine each MPI server runs) through ``pull_many`` / ``push_many``, and that work
for a step's traffic. :mod:`hybridrec.plan.mpi_probe` times the MPI store on the same
tables and sizes."""

from __future__ import annotations

import functools
from typing import Any

import torch

import ps
from hybridrec.plan.costs import StoreCosts
from hybridrec.plan.idlaw import TableTraffic
from hybridrec.plan.timing import DIM, fit_linear, timed


def make_optimizer(kind: str, lr: float = 0.01) -> Any:
    classes = {"sgd": ps.SGD, "rowwise_adagrad": ps.RowWiseAdagrad, "adagrad": ps.Adagrad,
               "adam": ps.Adam}  # fmt: skip
    if kind not in classes:
        raise ValueError(f"optimizer {kind!r}: expected one of {sorted(classes)}")
    return classes[kind](lr=lr)


def make_tables(store: Any, prefix: str, k: int, rows: int | None, optimizer: str) -> list[str]:
    names = [f"{prefix}{i}" for i in range(k)]
    for n in names:
        store.create_table(ps.TableSpec(name=n, num_rows=rows, dim=DIM,
                                        optimizer=make_optimizer(optimizer)))  # fmt: skip
    return names


def time_store(
    store: Any,
    by_optimizer: dict[str, list[str]],
    n: int,
    rows: int,
    reps: int,
    quantile: float = 0.5,
) -> dict[str, float]:
    """Seconds of one ``pull_many`` / conditional ``pull_many`` / ``push_many`` of ``n``
    distinct ids in each table of an optimizer (pulls: the first optimizer's tables)."""
    gen = torch.Generator().manual_seed(n)
    ids = torch.randperm(rows, generator=gen)[:n].sort().values
    grads = torch.full((n, DIM), 1e-3)
    out: dict[str, float] = {}
    for opt, tabs in by_optimizer.items():
        push = [ps.PushRequest(table=t, ids=ids, grads=grads) for t in tabs]
        out[f"push:{opt}"] = timed(functools.partial(store.push_many, push), reps, 2, quantile)
    tabs = next(iter(by_optimizer.values()))
    pull = [ps.PullRequest(table=t, ids=ids) for t in tabs]
    out["pull"] = timed(lambda: store.pull_many(pull), reps, 2, quantile)
    clocks = [store.clocks(t, ids) for t in tabs]
    check = [ps.PullRequest(table=t, ids=ids, clocks=c, bound=0)
             for t, c in zip(tabs, clocks, strict=True)]  # fmt: skip
    out["pull_check"] = timed(lambda: store.pull_many(check), reps, 2, quantile)
    return out


def store_grid(quick: bool) -> list[tuple[int, int]]:
    """``(tables, rows per table)`` sizes the stores are timed at."""
    return [(1, 64), (8, 64), (8, 1024)] if quick else [(1, 64), (8, 64), (1, 2048), (8, 2048)]


def calibrate_server(quick: bool, optimizers: list[str]) -> dict[str, StoreCosts]:
    """Per table request and per row, on a fixed table ("dense": what one MPI server
    holds, and each of several of its rows) and on a dynamic table ("sparse")."""
    rows = 20_000
    out = {}
    for layout, num_rows in (("dense", rows), ("sparse", None)):
        points: dict[str, list[tuple[float, float, float]]] = {}
        for k, n in store_grid(quick):
            store = ps.InProcessStore()
            by_opt = {o: make_tables(store, f"{o}_", k, num_rows, o) for o in optimizers}
            if num_rows is None:  # create the rows first: a shard holds rows it was pushed
                every = torch.arange(rows)
                store.push_many([ps.PushRequest(table=t, ids=every, grads=torch.zeros(rows, DIM))
                                 for names in by_opt.values() for t in names])  # fmt: skip
            got = time_store(store, by_opt, n, rows, 3 if quick else 9)
            for kind, s in got.items():
                points.setdefault(kind, []).append((float(k), float(k * n), s))
        out[layout] = StoreCosts(
            pull=fit_linear(points["pull"]),
            pull_check=fit_linear(points["pull_check"]),
            push={opt: fit_linear(points[f"push:{opt}"]) for opt in optimizers},
        )
    return out


def shard_seconds(
    shard: StoreCosts, optimizer: str, requests: float, pulled: float, pushed: float
) -> float:
    """The shard's work for ``requests`` pulls and pushes of ``pulled`` / ``pushed`` rows."""
    return shard.pull(requests, pulled) + shard.push_of(optimizer)(requests, pushed)


def store_share(shard: StoreCosts, t: TableTraffic) -> float:
    """One shard's work for one table's step of traffic ``t``."""
    extra = max(0.0, shard.pull.beta_s - shard.pull_check.beta_s)
    own = shard.pull(t.pull_requests, t.pulled) + shard.pull_check(t.check_requests, t.asked)
    return own + extra * t.refreshed + shard.push_of("rowwise_adagrad")(t.push_requests, t.pushed)
