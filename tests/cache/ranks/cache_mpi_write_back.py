"""Rank script: one worker trains through a CachedStore over a real MPI store that writes
its copies back (``CacheConfig.write_back="values"``, row-wise Adagrad, bounds (4, 4)),
and the same batches on an in-process store without a cache (the reference, in the
worker's own process).

Run as ``mpirun -n N python cache_mpi_write_back.py``: rank 0 is the worker, ranks 1 ..
N - 1 serve (a write of several servers goes to each its own rows). The records' pass
steps a copy with the servers' kernel's operations in their order and a ``WRITE``
message stores it as it is, so every served row and, after ``flush``, every row and
accumulator on the servers equal the reference's bit for bit. Prints ``rank R: ok
<role>``.
"""

from __future__ import annotations

import torch

import cache
import comm
import ps
from ps.mpi.server import serve_mpi
from ps.mpi.store import MPIStore

ROWS, DIM, STEPS, NAMES = 500, 8, 40, ("a", "b")


def train(store: ps.Store) -> list[torch.Tensor]:
    for n in NAMES:
        spec = ps.TableSpec(name=n, num_rows=ROWS, dim=DIM, optimizer=ps.RowWiseAdagrad(lr=0.05))
        store.create_table(spec)
    if isinstance(store, MPIStore):
        cfg = cache.CacheConfig(
            capacity_rows=50, read_bound=4, write_bound=4, sole_writer=True, policy="tinylfu",
            group_tables=True, write_back="values",
        )  # fmt: skip
        store = cache.CachedStore(store, cfg)
    g = torch.Generator().manual_seed(7)
    served = []
    for step in range(STEPS):
        ids = {n: (torch.rand(150, generator=g) ** 3 * ROWS).long() for n in NAMES}
        got = store.pull_many([ps.PullRequest(n, ids[n]) for n in NAMES])
        served.append(torch.cat([r.rows for r in got]))
        grads = [torch.sin(3 * r.rows + step) for r in got]
        store.push_many([ps.PushRequest(n, ids[n], x) for n, x in zip(NAMES, grads, strict=True)])
    if isinstance(store, cache.CachedStore):
        store.flush()
    return served


def main() -> None:
    group = comm.init("mpi")
    topology = comm.Topology(world_size=group.size, num_servers=group.size - 1)
    if topology.role(group.rank) is comm.Role.SERVER:
        serve_mpi(group, topology)
        print(f"rank {group.rank}: ok server", flush=True)
        return
    ref = ps.InProcessStore()
    want = train(ref)
    with MPIStore(group, topology, request_timeout_s=60.0) as mpi:
        got = train(mpi)
        for step, (a, b) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(a, b), f"step {step}: served rows differ from the uncached run"
        every = torch.arange(ROWS)
        for n in NAMES:
            assert torch.equal(mpi.pull(n, every).rows, ref.pull(n, every).rows), f"{n}: rows"
            assert torch.equal(mpi.state(n, every), ref.state(n, every)), f"{n}: accumulators"
        written = sum(int(mpi.stats()[n]["rows_written"]) for n in NAMES)
        assert written > 0, "no row was written back"
        # A bad write is refused whole, naming the table and the value; nothing changes.
        before = mpi.pull("b", every).rows
        ids, one = torch.tensor([3, 7]), torch.ones(2, 1)
        nan = torch.full((2, DIM), float("nan"))
        for bad, match in (
            (ps.WriteRequest("b", torch.tensor([3, 3]), one.expand(2, DIM), one,
                             torch.tensor([1, 1])), "distinct"),
            (ps.WriteRequest("b", ids, nan, one, torch.tensor([1, 1])), "row id 3"),
            (ps.WriteRequest("b", ids, one.expand(2, DIM), one, torch.tensor([1, -2])),
             "clock -2"),
        ):  # fmt: skip
            good = ps.WriteRequest("a", ids, torch.zeros(2, DIM), one, torch.tensor([9, 9]))
            try:
                mpi.write_many([good, bad])
            except ValueError as e:
                assert match in str(e) and "'b'" in str(e), e
            else:
                raise AssertionError(f"a bad write was taken ({match})")
            assert torch.equal(mpi.pull("b", every).rows, before)
            assert not bool((mpi.clocks("a", ids) == 9).any()), "the good part was applied"
    print(f"rank {group.rank}: ok worker ({written} rows written)", flush=True)


if __name__ == "__main__":
    main()
