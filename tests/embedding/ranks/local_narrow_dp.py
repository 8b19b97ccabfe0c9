"""Rank script: data-parallel local tables of fp16 and bf16 rows equal one process, bit for bit.

Every rank builds the same global batches (8 samples, seeded), trains its slice with a
mean loss, and after every step compares its rows, optimizer state and clocks with a
single-process collection trained on the whole batch. A row appears at most once per
global step and the rank counts are powers of two, so the gradient a replica applies
(its own bag's, divided by its slice and by the ranks, exchanged by allgatherv) is the
very float the single process applies (divided by the global batch): the narrow rows
then round alike, and the comparison is bit for bit. Row-wise Adagrad runs the narrow C
pass on the rows variant here (after the exchange) and on the parts variant there.

Backend from ``HYBRIDREC_TEST_BACKEND`` (set by tests/support/multiproc.py).
"""

from __future__ import annotations

import torch

import comm
import ps
from embedding import EmbeddingCollection, KeyedJaggedIds, TableConfig

GLOBAL_BATCH = 8  # divisible by 1, 2 and 4 ranks
STEPS = 4
TABLES = [
    TableConfig(
        name="items",
        num_rows=64,
        dim=8,
        feature_names=["clicked", "bought"],
        optimizer=ps.RowWiseAdagrad(lr=0.1),
        dtype="fp16",
    ),
    TableConfig(
        name="users",
        num_rows=40,
        dim=4,
        feature_names=["user"],
        optimizer=ps.Adam(lr=0.05),
        dtype="bf16",
    ),
]


def global_batch(gen: torch.Generator) -> KeyedJaggedIds:
    """Sum bags of 0-3 ids; a row of a table appears at most once in the global batch."""
    lists: dict[str, list[list[int]]] = {}
    for t in TABLES:
        assert t.num_rows is not None
        order = torch.randperm(t.num_rows, generator=gen).tolist()
        at = 0
        for feat in t.feature_names:
            samples = []
            for _ in range(GLOBAL_BATCH):
                n = int(torch.randint(0, 4, (1,), generator=gen))
                samples.append(order[at : at + n])
                at += n
            lists[feat] = samples
    return KeyedJaggedIds.from_lists(lists)


def mean_loss(pooled: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]) -> torch.Tensor:
    batch = next(iter(pooled.values())).shape[0]
    total = torch.zeros(())
    for feat, p in pooled.items():
        total = total + (p * targets[feat]).sum()
    return total / batch


def run(group: comm.ProcessGroup, args: list[str]) -> None:
    rank, size = group.rank, group.size
    local = GLOBAL_BATCH // size
    dp = EmbeddingCollection(TABLES, group=group)
    ref = EmbeddingCollection(TABLES)
    gen = torch.Generator().manual_seed(99)
    targets = {
        f: torch.randn(GLOBAL_BATCH, t.dim, generator=gen) for t in TABLES for f in t.feature_names
    }
    for step in range(STEPS):
        kjt = global_batch(gen)
        mine = kjt.sample_slice(rank * local, (rank + 1) * local)
        my_targets = {f: v[rank * local : (rank + 1) * local] for f, v in targets.items()}
        mean_loss(dp(mine), my_targets).backward()
        mean_loss(ref(kjt), targets).backward()
        for t in TABLES:
            ids = torch.arange(t.num_rows or 0)
            what = f"rank {rank}/{size} step {step} table {t.name}"
            for read in ("rows", "state", "clocks"):
                got, want = getattr(dp, read)(t.name, ids), getattr(ref, read)(t.name, ids)
                if not torch.equal(got, want):
                    diff = (got.double() - want.double()).abs().max()
                    raise AssertionError(f"{what}: {read} differ from one process (max {diff})")
    for t in TABLES:
        assert int(ref.clocks(t.name, torch.arange(t.num_rows or 0)).sum()) > 0, t.name
        assert dp.local is not None
    print(f"rank {rank}/{size}: ok narrow local data parallel ({group.backend})", flush=True)


if __name__ == "__main__":
    from tests.support.ranks.rank_main import run_main

    run_main(run)
