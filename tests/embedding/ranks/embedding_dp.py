"""Rank script: data-parallel EmbeddingCollection equals one process on the global batch.

Every rank builds the same global batches (same seed), trains on its slice of
the samples with a mean loss, and after every step compares its table rows,
optimizer state and clocks with a single-process EmbeddingCollection (a
LocalGroup and its own store) trained on the whole global batch, within a few times
that one process's fp32 rounding error (measured against the plain-torch ``Reference``
of embedding_sharded.py replayed in float64 on the same batches; ``tests/support/tolerance.py``).
It also checks
that all replicas are bit-identical. Raises AssertionError on any mismatch.
Tables of every placement but sharded run in one collection: local (fused, with
an unpooled feature and Adam) and hybrid (a replicated in-process store).

Backend from ``HYBRIDREC_TEST_BACKEND`` (set by tests/support/multiproc.py).
"""

from __future__ import annotations

import torch

import comm
import ps
from embedding import EmbeddingCollection, KeyedJaggedIds, RowWiseAdagrad, TableConfig
from tests.embedding.ranks.embedding_sharded import (
    UPDATE_ROUNDINGS,
    Reference,
    check_close,
    max_occurrences,
    ps_state,
    state_terms,
)

GLOBAL_BATCH = 8  # divisible by 1, 2 and 4 ranks
STEPS = 5
EMPTY_STEP = 2  # the first quarter of this step's samples have no ids at all

TABLES = [
    TableConfig(
        name="items", num_rows=40, dim=8, feature_names=["clicked", "bought"], pooling="sum",
        optimizer=RowWiseAdagrad(lr=0.1),
    ),
    TableConfig(
        name="users", num_rows=15, dim=4, feature_names=["user"], pooling="mean",
        optimizer=ps.SGD(lr=0.5), placement="hybrid",
    ),
    TableConfig(
        name="tokens", num_rows=12, dim=4, feature_names=["seq"], pooling="none",
        optimizer=ps.Adam(lr=0.05),
    ),
    TableConfig(
        name="tags", num_rows=10, dim=8, feature_names=["tag"], pooling="sum",
        optimizer=RowWiseAdagrad(lr=0.1), placement="hybrid",
    ),
]  # fmt: skip
SEQ_LEN = 3


def global_batch(gen: torch.Generator, step: int) -> KeyedJaggedIds:
    lists: dict[str, list[list[int]]] = {}
    for table in TABLES:
        for feat in table.feature_names:
            samples = []
            for b in range(GLOBAL_BATCH):
                n = int(torch.randint(0, 5, (1,), generator=gen))
                if table.pooling == "none":
                    n = SEQ_LEN
                assert table.num_rows is not None
                ids = torch.randint(0, min(6, table.num_rows), (n,), generator=gen)  # repeats
                if step == EMPTY_STEP and b < GLOBAL_BATCH // 4 and table.pooling != "none":
                    ids = ids[:0]
                samples.append(ids.tolist())
            lists[feat] = samples
    return KeyedJaggedIds.from_lists(lists)


def mean_loss(pooled: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean over samples of sum_f <pooled_f, target_f>."""
    batch = next(iter(pooled.values())).shape[0]
    total = torch.zeros(())
    for feat, p in pooled.items():
        total = total + (p * targets[feat]).sum()
    return total / batch


def run(group: comm.ProcessGroup, args: list[str]) -> None:
    """Train and compare on ``group`` (also called by battery.py); takes no arguments."""
    rank, size = group.rank, group.size
    if GLOBAL_BATCH % size != 0:
        raise ValueError(f"global batch {GLOBAL_BATCH} does not split over {size} ranks")
    local = GLOBAL_BATCH // size
    dp = EmbeddingCollection(TABLES, group=group)
    ref = EmbeddingCollection(TABLES)  # LocalGroup, its own InProcessStore
    ref64 = Reference(TABLES, dtype=torch.float64)
    occ: dict[str, int] = {}
    gen = torch.Generator().manual_seed(1234)
    targets = {
        f: torch.randn(
            GLOBAL_BATCH, *([SEQ_LEN] if t.pooling == "none" else []), t.dim, generator=gen
        )  # fmt: skip
        for t in TABLES
        for f in t.feature_names
    }
    for step in range(STEPS):
        kjt = global_batch(gen, step)
        mine = kjt.sample_slice(rank * local, (rank + 1) * local)
        my_targets = {f: t[rank * local : (rank + 1) * local] for f, t in targets.items()}
        mean_loss(dp(mine), my_targets).backward()
        mean_loss(ref(kjt), targets).backward()
        mean_loss(ref64.forward(kjt), targets).backward()
        ref64.step(kjt)
        occ = {n: max(k, occ.get(n, 0)) for n, k in max_occurrences(TABLES, kjt).items()}
        for t in TABLES:
            ids = torch.arange(t.num_rows or 0)
            what = f"rank {rank}/{size} step {step} table {t.name}"
            got_rows, want_rows = dp.rows(t.name, ids), ref.rows(t.name, ids)
            got_clocks, want_clocks = dp.clocks(t.name, ids), ref.clocks(t.name, ids)
            check_close(
                f"{what}: rows",
                got_rows,
                want_rows,
                ref64.bags[t.name].weight,
                occ[t.name] + UPDATE_ROUNDINGS,
            )
            if not torch.equal(got_clocks, want_clocks):
                raise AssertionError(
                    f"rank {rank}/{size} step {step} table {t.name}: clocks "
                    f"{got_clocks.tolist()} != reference {want_clocks.tolist()}"
                )
            if not isinstance(t.optimizer, ps.SGD):
                check_close(
                    f"{what}: optimizer state",
                    dp.state(t.name, ids),
                    ref.state(t.name, ids),
                    ps_state(ref64, t),
                    state_terms(t, occ[t.name]),
                )
            # Every replica applied the identical update: bitwise equal everywhere.
            everyone = group.allgather(got_rows.contiguous())  # [size, R, D]
            if not bool((everyone == everyone[0]).all()):
                raise AssertionError(
                    f"rank {rank}/{size} step {step} table {t.name}: replicas diverged"
                )
    for t in TABLES:
        moved = int(ref.clocks(t.name, torch.arange(t.num_rows or 0)).sum())
        assert moved > 0, f"the test never updated a row of {t.name}"
    print(f"rank {rank}/{size}: ok embedding data parallel ({group.backend})", flush=True)


if __name__ == "__main__":  # tests may import this file for its helpers
    from tests.support.ranks.rank_main import run_main

    run_main(run)
