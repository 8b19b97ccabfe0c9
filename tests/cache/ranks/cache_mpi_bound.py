"""Rank script: workers train through a CachedStore over a real MPI store.

Run as ``mpirun -n N python cache_mpi_bound.py --servers S --read-bound R --write-bound W
[--device host|cpu|cuda]``; the last ``S`` ranks serve, the other ``N - S`` are workers.
``--device`` is where the cache keeps its rows (``host``: records in host memory; ``cpu``
or ``cuda``: tensors on that device, every worker sharing GPU 0; rows are served there
and gradients pushed from there). Two tables share one cache
(``group_tables``) and each step is what the hybrid embedding tables make: the next
batch's ids handed to ``prefetch_many``, ONE batched pull (at most one message per
server: this batch's verifying pull and the next batch's misses), ONE batched push.
Every step each worker in turn pulls its batch (the others wait at a barrier, so no PS
clock moves between a pull and the checks that follow it) and checks, for every served
row,

* by direct comparison: ``store.clocks(ids)`` (the PS clocks right now) minus the clocks
  the served copies were read at is at most the read bound;
* that the cache's exact staleness histogram counted the same values;

then all workers push. Gradients are multiples of 1/8 and SGD's lr is 1/2, so sums are
exact in any order: after ``flush`` the PS rows must equal minus lr times the sum of every
worker's gradients (nothing lost, nothing applied twice). With one worker and bounds 0 the
served rows must also equal a plain InProcessStore fed the same pushes (bit-identical).

Every rank prints ``rank R: ok <role> ...``; any failed check raises.
"""

from __future__ import annotations

import argparse

import torch

import cache
import comm
import ps
from ps.mpi.server import serve_mpi
from ps.mpi.store import MPIStore
from tests.support.tolerance import assert_same

ROWS, DIM, STEPS = 120, 4, 40
SGD = ps.SGD(lr=0.5)
# Rows from 0, gradients multiples of 1/8, lr 1/2: every partial sum and every update is
# exact in float32 (fused or not), so any grouping and order of the pushes gives the same bits.
EXACT = "SGD lr 1/2 from 0 on multiples of 1/8: every sum exact in float32"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--servers", type=int, required=True)
    p.add_argument("--read-bound", type=int, required=True)
    p.add_argument("--write-bound", type=int, required=True)
    p.add_argument("--device", choices=["host", "cpu", "cuda"], default="host")
    args = p.parse_args()
    device = None if args.device == "host" else torch.device(args.device)
    if device is not None and device.type == "cuda":
        device = torch.device("cuda", 0)  # the workers share one GPU
    group = comm.init("mpi")
    topology = comm.Topology(world_size=group.size, num_servers=args.servers)
    mates = topology.role_group(group)
    if topology.role(group.rank) is comm.Role.SERVER:
        serve_mpi(group, topology)
        print(f"rank {group.rank}: ok server", flush=True)
        return
    s_r = args.read_bound
    names = ("t", "u")  # two tables of one dim: they share one cache
    every = torch.arange(ROWS)
    with MPIStore(group, topology, request_timeout_s=60.0) as mpi:
        if mates.rank == 0:
            for n in names:
                mpi.create_table(ps.TableSpec(name=n, num_rows=ROWS, dim=DIM, optimizer=SGD))
                mpi.push(n, every, 2 * mpi.pull(n, every).rows)  # rows := 0 exactly
        mates.barrier()
        cfg = cache.CacheConfig(
            capacity_rows=15,  # per table: 30 shared
            read_bound=s_r,
            write_bound=args.write_bound,
            exact_staleness=True,
            evict_chunk=4,
            group_tables=True,
            prefetch="on",  # the bounds hold for prefetched rows too
        )
        store = cache.CachedStore(mpi, cfg, device=device)
        on = device or torch.device("cpu")
        plain = None
        if mates.size == 1:
            plain = ps.InProcessStore()
            for n in names:
                plain.create_table(ps.TableSpec(name=n, num_rows=ROWS, dim=DIM, optimizer=SGD))
                plain.push(n, every, 2 * plain.pull(n, every).rows)
        gen = torch.Generator().manual_seed(100 + mates.rank)
        hot = torch.randperm(ROWS, generator=torch.Generator().manual_seed(0))[:20]
        # Half hot rows shared by all workers, half random: rows go stale and are evicted.
        batches = [
            {
                n: torch.unique(
                    torch.cat(
                        [
                            hot[torch.randint(0, 20, (6,), generator=gen)],
                            torch.randint(0, ROWS, (6,), generator=gen),
                        ]
                    )
                )
                for n in names
            }
            for _ in range(STEPS + 1)
        ]
        total = {n: torch.zeros(ROWS, DIM) for n in names}
        direct: dict[int, int] = {}
        for step in range(STEPS):
            ids = batches[step]
            # The next batch's ids ride on this step's pull (one message per server).
            store.prefetch_many([ps.PullRequest(n, i) for n, i in batches[step + 1].items()])
            for turn in range(mates.size):
                if turn == mates.rank:
                    before = mpi.request_counts()
                    got = store.pull_many([ps.PullRequest(n, i) for n, i in ids.items()])
                    sent = mpi.request_counts()["pull_messages"] - before["pull_messages"]
                    assert sent <= args.servers, f"step {step}: {sent} pull messages"
                    for n, g in zip(names, got, strict=True):
                        assert g.rows.device == on, (g.rows.device, on)
                        lag = mpi.clocks(n, ids[n]) - g.clocks  # [U]
                        assert int(lag.max()) <= s_r, f"step {step}: lags {lag.tolist()} > {s_r}"
                        for v in lag.tolist():
                            direct[v] = direct.get(v, 0) + 1
                        if plain is not None:
                            want = plain.pull(n, ids[n]).rows
                            assert_same(g.rows.cpu(), want, what=f"step {step} {n}", why=EXACT)
                mates.barrier()
            grads = {
                n: torch.randint(-8, 9, (i.numel(), DIM), generator=gen).float() / 8
                for n, i in ids.items()
            }
            store.push_many([ps.PushRequest(n, ids[n], grads[n].to(on)) for n in names])
            for n in names:
                if plain is not None:
                    plain.push(n, ids[n], grads[n])
                total[n][ids[n]] += grads[n]
            mates.barrier()
        st = store.cache_stats()["t+u"]
        assert st["staleness_exact"] is True
        assert st["staleness_served"] == dict(sorted(direct.items())), (st, direct)
        assert st["max_staleness_served"] <= s_r, st
        if mates.size > 1 and s_r > 0:
            assert st["max_staleness_served"] > 0, st  # other workers' pushes were seen
            assert st["rows_saved_by_bound"] > 0, st
        assert st["evictions"] > 0 and st["prefetched"] > 0, st
        store.flush()
        for n in names:
            mates.allreduce(total[n], op="sum")
        mates.barrier()
        for n in names:
            want = -0.5 * total[n]
            got_rows = mpi.pull(n, every).rows
            assert_same(got_rows, want, what=f"{n} rows after flush", why=EXACT)
            if plain is not None:
                want = plain.pull(n, every).rows
                assert_same(got_rows, want, what=f"{n} rows against the plain store", why=EXACT)
        summary = (
            f"hit_rate={st['hit_rate']:.2f} staleness={st['staleness_served']} "
            f"evicted_pending={st['evicted_pending']}"
        )
        store.close()
    print(f"rank {group.rank}: ok worker {summary}", flush=True)


if __name__ == "__main__":
    main()
