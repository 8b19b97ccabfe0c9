"""Rank script: data parallel where a rank's batch lacks every feature of a placement.

One collection with a local table, a hybrid table (replicated in-process store) and a
sharded table. At step 1 the last rank's batch has no local feature at all (the keys
are absent, not empty), at step 2 no hybrid feature, at step 3 no sharded feature. That
rank must still take part in the backward exchange of that placement (its peers would
wait for it until the comm timeout otherwise), and every table must equal one process
trained on the global batch, where those samples have empty bags for those features
(within a few times that one process's fp32 rounding error, measured against the
plain-torch ``Reference`` of embedding_sharded.py replayed in float64 on the same batches;
``tests/support/tolerance.py``).

Backend from ``HYBRIDREC_TEST_BACKEND`` (set by tests/support/multiproc.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

import comm
import ps
from embedding import EmbeddingCollection, KeyedJaggedIds, RowWiseAdagrad, TableConfig
from tests.embedding.ranks.embedding_sharded import (
    UPDATE_ROUNDINGS,
    Reference,
    check_close,
    max_occurrences,
)

GLOBAL_BATCH = 8  # divisible by 1, 2 and 4 ranks
STEPS = 4
TABLES = [
    TableConfig(
        name="items", num_rows=30, dim=4, feature_names=["clicked", "bought"],
        optimizer=RowWiseAdagrad(lr=0.1),
    ),
    TableConfig(
        name="users", num_rows=20, dim=4, feature_names=["user"], optimizer=ps.SGD(lr=0.5),
        placement="hybrid",
    ),
    TableConfig(
        name="tags", num_rows=16, dim=4, feature_names=["tag"],
        optimizer=RowWiseAdagrad(lr=0.1), placement="sharded",
    ),
]  # fmt: skip
MISSING = {1: "local", 2: "hybrid", 3: "sharded"}  # step -> placement the last rank lacks


def global_batch(gen: torch.Generator, step: int, last: range) -> KeyedJaggedIds:
    """Random ids; the samples in ``last`` have no ids for MISSING[step]'s features."""
    lists: dict[str, list[list[int]]] = {}
    for table in TABLES:
        assert table.num_rows is not None
        for feat in table.feature_names:
            samples = []
            for b in range(GLOBAL_BATCH):
                n = int(torch.randint(1, 4, (1,), generator=gen))
                ids = torch.randint(0, table.num_rows, (n,), generator=gen)
                if MISSING.get(step) == table.placement and b in last:
                    ids = ids[:0]
                samples.append(ids.tolist())
            lists[feat] = samples
    return KeyedJaggedIds.from_lists(lists)


def loss(
    out: dict[str, torch.Tensor], targets: dict[str, torch.Tensor], batch: int
) -> torch.Tensor:
    total = torch.zeros(())
    for feat, pooled in out.items():
        total = total + (pooled * targets[feat]).sum()
    return total / batch


def check_checkpoint(dp: EmbeddingCollection, group: comm.ProcessGroup, path: Path) -> None:
    """``save`` (collective: local + sharded tables whole) loads back into a fresh
    collection on the same ranks, and into one process with the sharded table local."""
    dp.save(path)
    fresh = EmbeddingCollection(TABLES, group=group)
    fresh.load(path)
    alone = EmbeddingCollection(
        [
            dataclasses.replace(t, placement="local") if t.placement == "sharded" else t
            for t in TABLES
        ]
    )
    alone.load(path)
    for t in TABLES:
        if t.placement == "hybrid":
            continue  # in the store: store.save
        ids = torch.arange(t.num_rows or 0)
        if t.placement == "sharded":
            assert dp.sharded is not None and fresh.sharded is not None
            want = dp.sharded.full_table(t.name)  # type: ignore[operator]
            got = fresh.sharded.full_table(t.name)  # type: ignore[operator]
            state = fresh.sharded.full_state(t.name)  # type: ignore[operator]
            want_state = dp.sharded.full_state(t.name)  # type: ignore[operator]
            assert torch.equal(state, want_state), f"{t.name}: state not restored"
        else:
            want, got = dp.rows(t.name, ids), fresh.rows(t.name, ids)
        if not (torch.equal(got, want) and torch.equal(alone.rows(t.name, ids), want)):
            raise AssertionError(f"rank {group.rank}: table {t.name} not restored from {path}")
    # A save that fails on rank 0 raises on every rank (no rank waits for it).
    try:
        dp.save("/proc/hybridrec-no-such-dir/ckpt")
    except (OSError, RuntimeError) as e:
        assert group.rank == 0 or "failed on rank 0" in str(e), e
    else:
        raise AssertionError(f"rank {group.rank}: a save to /proc did not raise")


def run(group: comm.ProcessGroup, args: list[str]) -> None:
    """Train and compare on ``group`` (also called by battery.py); ``args``: [checkpoint folder]."""
    rank, size = group.rank, group.size
    local = GLOBAL_BATCH // size
    mine_range = range(rank * local, (rank + 1) * local)
    last = range((size - 1) * local, size * local)
    dp = EmbeddingCollection(TABLES, group=group)
    ref = EmbeddingCollection(TABLES)  # one process, the global batch
    ref64 = Reference(TABLES, dtype=torch.float64)
    occ: dict[str, int] = {}
    gen = torch.Generator().manual_seed(7)
    feats = [f for t in TABLES for f in t.feature_names]
    targets = {f: torch.randn(GLOBAL_BATCH, 4, generator=gen) for f in feats}
    for step in range(STEPS):
        kjt = global_batch(gen, step, last)
        mine = kjt.sample_slice(mine_range.start, mine_range.stop)
        if rank == size - 1 and step in MISSING and size > 1:
            keep = [f for t in TABLES if t.placement != MISSING[step] for f in t.feature_names]
            mine = mine.select(keep)  # the keys are absent, not just empty
        my_targets = {f: t[mine_range.start : mine_range.stop] for f, t in targets.items()}
        loss(dp(mine), my_targets, local).backward()
        loss(ref(kjt), targets, GLOBAL_BATCH).backward()
        loss(ref64.forward(kjt), targets, GLOBAL_BATCH).backward()
        ref64.step(kjt)
        occ = {n: max(k, occ.get(n, 0)) for n, k in max_occurrences(TABLES, kjt).items()}
        for t in TABLES:
            ids = torch.arange(t.num_rows or 0)
            if t.placement == "sharded":
                assert dp.sharded is not None and ref.sharded is not None
                got = dp.sharded.full_table(t.name)  # type: ignore[operator]
                want = ref.sharded.full_table(t.name)  # type: ignore[operator]
            else:
                got, want = dp.rows(t.name, ids), ref.rows(t.name, ids)
            check_close(
                f"rank {rank}/{size} step {step} table {t.name}: rows",
                got,
                want,
                ref64.bags[t.name].weight,
                occ[t.name] + UPDATE_ROUNDINGS,
            )
    if args:
        check_checkpoint(dp, group, Path(args[0]) / "emb")
    print(f"rank {rank}/{size}: ok missing placements", flush=True)


if __name__ == "__main__":  # tests may import this file for its helpers
    from tests.support.ranks.rank_main import run_main

    run_main(run)
