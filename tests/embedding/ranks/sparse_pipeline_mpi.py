"""Rank script: workers train hybrid tables with the sparse pipeline over a real MPI store.

Run as ``mpirun -n N python sparse_pipeline_mpi.py [--cache]``; the last rank serves,
the other ``N - 1`` are workers. Every worker trains an ``EmbeddingCollection`` of two
hybrid tables (SGD, lr 1/2, rows set to 0) with ``set_sparse_pipeline(True)``, in the
trainer's order: announce the next batch, forward, backward. The loss is
``sum(pooled * C)`` with ``C`` multiples of 1/8, so every row gradient, every push
(divided by the 1, 2 or 4 workers) and every sum is exact in float32 in any order:
after the flush, the PS rows must equal ``-lr / workers`` times the sum of every
worker's gradients (nothing lost or applied twice by the background pushes, whatever
their interleaving). ``--cache``: through a cache (bounds (2, 2)), whose pending sums
must all arrive too. With several workers, the pipeline over per-rank replicas must be
refused (its pushes are collectives), naming the tables.

Every rank prints ``rank R: ok <role>``; any failed check raises.
"""

from __future__ import annotations

import argparse

import torch

import cache
import comm
import ps
from embedding import EmbeddingCollection, KeyedJaggedIds, TableConfig
from ps.mpi.server import serve_mpi
from ps.mpi.store import MPIStore
from tests.support.tolerance import assert_same

ROWS, DIM, STEPS, BATCH = 200, 4, 30, 16
EXACT = "SGD lr 1/2 from 0 on multiples of 1/8 (over 1, 2 or 4 workers): every sum exact"


def _tables() -> list[TableConfig]:
    sgd = ps.SGD(lr=0.5)
    return [
        TableConfig(name="t", num_rows=ROWS, dim=DIM, feature_names=["a"], optimizer=sgd,
                    placement="hybrid"),
        TableConfig(name="u", num_rows=ROWS, dim=DIM, feature_names=["b", "c"], optimizer=sgd,
                    placement="hybrid"),
    ]  # fmt: skip


def _batch(gen: torch.Generator, hot: torch.Tensor) -> KeyedJaggedIds:
    """Three features of BATCH bags, two ids each: half from 20 rows every worker uses."""
    n = 3 * BATCH * 2
    ids = torch.where(
        torch.rand(n, generator=gen) < 0.5,
        hot[torch.randint(0, hot.numel(), (n,), generator=gen)],
        torch.randint(0, ROWS, (n,), generator=gen),
    )
    return KeyedJaggedIds(["a", "b", "c"], ids, torch.full((3 * BATCH,), 2, dtype=torch.int64))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cache", action="store_true")
    args = p.parse_args()
    group = comm.init("mpi")
    topology = comm.Topology(world_size=group.size, num_servers=1)
    mates = topology.role_group(group)
    if topology.role(group.rank) is comm.Role.SERVER:
        serve_mpi(group, topology)
        print(f"rank {group.rank}: ok server", flush=True)
        return
    if mates.size > 1:  # per-rank replicas: every push is an allgatherv
        replicas = EmbeddingCollection(_tables(), store=ps.InProcessStore(), group=mates)
        try:
            replicas.set_sparse_pipeline(True)
        except ValueError as e:
            assert "['t', 'u']" in str(e) and "shared" in str(e), e
        else:
            raise AssertionError("the pipeline over per-rank replicas was not refused")
    every = torch.arange(ROWS)
    with MPIStore(group, topology, request_timeout_s=60.0) as mpi:
        store: ps.Store = mpi
        if args.cache:
            cfg = cache.CacheConfig(capacity_rows=30, read_bound=2, write_bound=2,
                                    group_tables=True, evict_chunk=4)  # fmt: skip
            store = cache.CachedStore(mpi, cfg)
        emb = EmbeddingCollection(_tables(), store=store, group=mates)
        if mates.rank == 0:
            for n in ("t", "u"):
                mpi.push(n, every, 2 * mpi.pull(n, every).rows)  # rows := 0 exactly
        mates.barrier()
        emb.set_sparse_pipeline(True)
        gen = torch.Generator().manual_seed(100 + mates.rank)
        hot = torch.randperm(ROWS, generator=torch.Generator().manual_seed(0))[:20]
        batches = [_batch(gen, hot) for _ in range(STEPS + 1)]
        total = {n: torch.zeros(ROWS, DIM) for n in ("t", "u")}
        table_of = {"a": "t", "b": "u", "c": "u"}
        for step in range(STEPS):
            kjt = batches[step]
            emb.prefetch(batches[step + 1])
            pooled = emb(kjt)  # {feature: [BATCH, DIM]}
            coef = {
                f: torch.randint(-8, 9, (BATCH, DIM), generator=gen).float() / 8 for f in kjt.keys
            }
            loss = sum((pooled[f] * coef[f]).sum() for f in kjt.keys)
            loss.backward()  # pushes on the pipeline's thread
            for f in kjt.keys:
                ids = kjt.key_slice(f).ids.view(BATCH, 2)
                for j in range(2):  # sum pooling: each id of a bag gets the bag's gradient
                    total[table_of[f]].index_add_(0, ids[:, j], coef[f])
        assert emb.sparse_pipelined
        emb.hybrid.flush()  # type: ignore[union-attr]  # drains the pipeline, then the cache
        for n in total:
            mates.allreduce(total[n], op="sum")
        mates.barrier()
        for n in total:
            want = -0.5 * total[n] / mates.size
            assert_same(mpi.pull(n, every).rows, want, what=f"{n} rows after flush", why=EXACT)
        emb.set_sparse_pipeline(False)
        if args.cache:
            store.close()
    print(f"rank {group.rank}: ok worker", flush=True)


if __name__ == "__main__":
    main()
