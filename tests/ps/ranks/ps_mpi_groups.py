"""Rank script: group requests over the MPI store in bulk (``ps.mpi.group_messages``)
against the same requests cut by table (the base class's ``ps.Store.pull_groups_async``
/ ``push_groups_async`` called on the store: one request per table, then
``pull_many_async`` / ``push_many_async``) on twin tables.

Run as ``mpirun -n N python ps_mpi_groups.py --servers S``: the last ``S`` ranks serve,
rank 0 is the one worker. Twin sets of three tables ("g*" go in bulk, "t*" by table)
have the same specs and init seeds, so they start equal; they get the same pushes
(plain and counted, some tables absent from a step, counted pushes with plain parts,
repeated ids), and each step's pulls (plain, conditional, with state) must agree bit for
bit, as must every row, state and clock at the end: the servers run the same kernels
on messages of the same words. The bulk path must be the one taken: while the "g"
tables are used, the base class's methods raise. Requests it leaves to the per-table
path -- a NaN gradient, a count of 0, an empty pull -- give that path's errors and
results, and change nothing.

Every rank prints ``rank R: ok <role> ...`` at the end; any failed check raises.
"""

from __future__ import annotations

import argparse
import contextlib
import re
from collections.abc import Iterator

import numpy as np
import torch

import comm
import ps
from ps.group_requests import GroupPull, GroupPush, IdSpace
from ps.mpi.server import serve_mpi
from ps.mpi.store import MPIStore

DIM = 8
ROWS = {"a": 70, "b": 40, "c": 90}
BASES = np.array([0, 70, 110, 200], dtype=np.int64)


def specs(prefix: str) -> list[ps.TableSpec]:
    """The three tables, row-wise Adagrad (counted pushes sum in sub-steps), seeded init."""
    return [
        ps.TableSpec(
            name=f"{prefix}{name}",
            num_rows=rows,
            dim=DIM,
            optimizer=ps.RowWiseAdagrad(lr=0.1),
            init=ps.UniformInit(low=-0.1, high=0.1, seed=k + 1),
        )
        for k, (name, rows) in enumerate(ROWS.items())
    ]


def space(prefix: str) -> IdSpace:
    return IdSpace(tuple(f"{prefix}{n}" for n in ROWS), BASES)


@contextlib.contextmanager
def per_table_path_forbidden() -> Iterator[None]:
    """The base class's group methods raise meanwhile: the bulk path must take every request."""

    def refuse(self: ps.Store, requests: object) -> None:
        raise AssertionError("a group request went the per-table way")

    saved = ps.Store.pull_groups_async, ps.Store.push_groups_async
    ps.Store.pull_groups_async, ps.Store.push_groups_async = refuse, refuse  # type: ignore[assignment]
    try:
        yield
    finally:
        ps.Store.pull_groups_async, ps.Store.push_groups_async = saved  # type: ignore[method-assign]


def by_table_pull(store: MPIStore, r: GroupPull) -> ps.PullResult:
    (got,) = ps.Store.pull_groups_async(store, [r]).wait()
    return got


def by_table_push(store: MPIStore, r: GroupPush) -> None:
    ps.Store.push_groups_async(store, [r]).wait()


def same(what: str, a: ps.PullResult, b: ps.PullResult) -> None:
    for field in ("rows", "clocks", "positions", "state"):
        x, y = getattr(a, field), getattr(b, field)
        assert (x is None) == (y is None), (what, field, x, y)
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(x, y), (what, field, x, y)


def packed_ids(g: torch.Generator, skip: int | None) -> torch.Tensor:
    """Sorted distinct packed ids of every table but number ``skip``."""
    parts = []
    for i, rows in enumerate(ROWS.values()):
        if i != skip:
            ids = torch.randint(0, rows, (rows // 2,), generator=g).unique()
            parts.append(ids + int(BASES[i]))
    return torch.cat(parts)


def step(store: MPIStore, g: torch.Generator, k: int) -> int:
    """One step on both twins: pulls compared, then the same push. Returns the checks."""
    packed = packed_ids(g, skip=k % 4 if k % 4 < 3 else None)
    n = packed.numel()
    clocks = torch.randint(-1, 3 + k, (n,), generator=g)
    pulls = [
        lambda p: GroupPull(space(p), packed),
        lambda p: GroupPull(space(p), packed, with_state=True),
        lambda p: GroupPull(space(p), packed, clocks, 1),
        lambda p: GroupPull(space(p), packed, clocks, 0, with_state=True),
    ]
    for make in pulls:
        with per_table_path_forbidden():
            (bulk,) = store.pull_groups_async([make("g")]).wait()
        same(f"step {k} pull", bulk, by_table_pull(store, make("t")))
    # A push of any order, with a repeated id at odd steps; counted at steps 2 and 3
    # (step 3: every count 1 in table a, so its part is a plain one).
    ids = packed[torch.randperm(n, generator=g)]
    if k % 2:
        ids = torch.cat([ids, ids[:3]])
    grads = torch.randn(ids.numel(), DIM, generator=g)
    counts = stats = None
    if k in (2, 3):
        counts = torch.randint(1, 4, (ids.numel(),), generator=g)
        if k == 3:
            counts[ids < int(BASES[1])] = 1
        stats = (grads * grads).mean(dim=1, keepdim=True) * counts.unsqueeze(1)
    with per_table_path_forbidden():
        store.push_groups_async([GroupPush(space("g"), ids, grads, counts, stats)]).wait()
    by_table_push(store, GroupPush(space("t"), ids, grads, counts, stats))
    return len(pulls) + 1


def tables_equal(store: MPIStore) -> int:
    for name, rows in ROWS.items():
        every = torch.arange(rows)
        a, b = store.pull(f"g{name}", every), store.pull(f"t{name}", every)
        same(f"table {name}", a, b)
        assert torch.equal(store.state(f"g{name}", every), store.state(f"t{name}", every))
    return len(ROWS)


def left_to_the_per_table_path(store: MPIStore) -> int:
    """Requests the bulk path does not take: the per-table path's error or result."""
    before = {n: store.pull(f"g{n}", torch.arange(r)) for n, r in ROWS.items()}
    nan = torch.ones(2, DIM)
    nan[1, 2] = float("nan")
    bad = [
        (GroupPush(space("g"), torch.tensor([4, 130]), nan), "push table 'gc'.*row id 20"),
        (
            GroupPush(
                space("g"),
                torch.tensor([4, 80]),
                torch.ones(2, DIM),
                torch.tensor([1, 0]),
                torch.zeros(2, 1),
            ),
            "push table 'gb': count 0 for row id 10",
        ),  # fmt: skip
    ]
    for request, message in bad:
        try:
            store.push_groups_async([request]).wait()
        except ValueError as e:
            assert re.search(message, str(e)), (message, str(e))
        else:
            raise AssertionError(f"no error for {message}")
    for n, r in ROWS.items():
        same(f"unchanged {n}", store.pull(f"g{n}", torch.arange(r)), before[n])
    empty = GroupPull(space("g"), torch.empty(0, dtype=torch.int64))
    (got,) = store.pull_groups_async([empty]).wait()
    assert got.rows.shape == (0, DIM) and got.clocks.numel() == 0
    return len(bad) + 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--servers", type=int, required=True)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    group = comm.init("mpi")
    topology = comm.Topology(world_size=group.size, num_servers=args.servers)
    topology.role_group(group)  # collective: the workers' (or servers') sub-group
    if topology.role(group.rank) is comm.Role.SERVER:
        serve_mpi(group, topology)
        print(f"rank {group.rank}: ok server", flush=True)
        return
    n = 0
    with MPIStore(group, topology, request_timeout_s=60.0) as store:
        for spec in specs("g") + specs("t"):
            store.create_table(spec)
        n += tables_equal(store)
        g = torch.Generator().manual_seed(args.servers)
        for k in range(args.steps):
            n += step(store, g, k)
        n += tables_equal(store)
        n += left_to_the_per_table_path(store)
    print(f"rank {group.rank}: ok worker {n} checks", flush=True)


if __name__ == "__main__":
    main()
