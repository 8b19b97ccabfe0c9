"""Rank script: one worker trains through a CachedStore over a real MPI store whose tables
use row-wise Adagrad and Adam; the cached copies take the optimizer's local step with the
rows' state read from the servers (``Store.state_many``, every table's reads in flight
together).

Run as ``mpirun -n N python cache_mpi_local_step.py``: rank 0 is the worker, ranks 1 ..
N - 1 serve. Bounds (3, 0) and the worker the tables' only writer: every update reaches
the servers as the copy takes it, so after every pull the served copies must equal the
servers' rows right then (``mpi.pull``: a direct comparison), up to the rounding of the
two sides' kernels; with the SGD step they are far off (checked too). Tables of one
optimizer share one cache (``group_tables``). Prints ``rank R: ok <role>``.
"""

from __future__ import annotations

import numpy as np
import torch

import cache
import comm
import ps
from ps.mpi.server import serve_mpi
from ps.mpi.store import MPIStore
from tests.support.tolerance import sum_tol

ROWS, DIM, STEPS = 400, 16, 30
OPTS = {"a": ps.RowWiseAdagrad(lr=0.05), "b": ps.RowWiseAdagrad(lr=0.05), "c": ps.Adam(lr=0.01)}


def train(mpi: MPIStore, step: str, tag: str) -> float:
    """Train the tables ``<tag><name>`` through a cache with local step ``step``; returns
    the largest difference of a served copy to the servers' row, checked against the
    rounding tolerance when ``step`` is the optimizer's."""
    names = [tag + n for n in OPTS]
    for n, opt in zip(names, OPTS.values(), strict=True):
        mpi.create_table(ps.TableSpec(name=n, num_rows=ROWS, dim=DIM, optimizer=opt))
    cfg = cache.CacheConfig(capacity_rows=60, read_bound=3, write_bound=0, sole_writer=True,
                            group_tables=True, local_step=step)  # type: ignore[arg-type]  # fmt: skip
    store = cache.CachedStore(mpi, cfg)
    rng = np.random.default_rng(5)
    worst = 0.0
    for i in range(STEPS):
        ids = {n: torch.from_numpy((rng.zipf(1.2, size=40) - 1) % ROWS) for n in names}
        got = store.pull_many([ps.PullRequest(n, ids[n]) for n in names])
        for n, r in zip(names, got, strict=True):
            want = mpi.pull(n, ids[n]).rows
            diff = float((r.rows - want).abs().max())
            worst = max(worst, diff)
            # Both sides took the same optimizer steps; each rounds a few times per update.
            tol = sum_tol(torch.float32, 8 * (i + 1), float(want.abs().max()) + 0.05 * (i + 1))
            if step == "optimizer":
                assert diff <= tol, f"step {i} {n}: copy {diff} from the servers' row > {tol}"
        grads = {n: torch.from_numpy(rng.standard_normal((40, DIM)).astype(np.float32))
                 for n in names}  # fmt: skip
        store.push_many([ps.PushRequest(n, ids[n], grads[n]) for n in names])
    st = store.cache_stats()
    assert all(s["hits"] > 0 for s in st.values()), st
    store.close()
    return worst


def main() -> None:
    group = comm.init("mpi")
    topology = comm.Topology(world_size=group.size, num_servers=group.size - 1)
    if topology.role(group.rank) is comm.Role.SERVER:
        serve_mpi(group, topology)
        print(f"rank {group.rank}: ok server", flush=True)
        return
    with MPIStore(group, topology, request_timeout_s=60.0) as mpi:
        by_opt = train(mpi, "optimizer", "o")
        by_sgd = train(mpi, "sgd", "s")
        assert by_sgd > 100 * max(by_opt, 1e-6), (by_opt, by_sgd)
    print(f"rank {group.rank}: ok worker copy-to-server {by_opt:.2e} (sgd {by_sgd:.2e})",
          flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
