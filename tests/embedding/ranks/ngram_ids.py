"""Rank script: every rank computes the same hashed n-gram ids.

Each rank builds the same seeded token batches (a GPT-2-sized and a byte vocabulary),
but computes their ids its own way: its batch rows in a rank-dependent order (then put
back), with a rank-dependent number of torch threads. It then allgathers the ids and
checks they are identical on every rank, for every ``n``, both hash modes and several
seeds (one of them large), plus :meth:`embedding.NGramConfig.ids` with sub-tables.
Each rank prints ``rank R/S: ok ngram ids <sha256 of the ids>``; the test compares the
digest with the ids it computes in its own process.

Backend from ``HYBRIDREC_TEST_BACKEND`` (set by tests/support/multiproc.py).
"""

from __future__ import annotations

import hashlib

import torch

import comm
from embedding import NGramConfig, ngram_ids

VOCABS = (50257, 256)
NS = (1, 2, 3, 5)
ROWS = (None, 1_000_003)
SEEDS = (0, 7, 2**63 - 25)
BATCH, SEQ = 4, 33


def tokens(vocab: int) -> torch.Tensor:
    """The seeded token batch of ``vocab``: int64 ``[BATCH, SEQ]`` (the same on every rank)."""
    gen = torch.Generator().manual_seed(vocab)
    return torch.randint(0, vocab, (BATCH, SEQ), generator=gen)


def all_ids(order: torch.Tensor | None = None) -> torch.Tensor:
    """Every case's ids, concatenated: int64 ``[cases * BATCH * SEQ]``.

    ``order`` (a permutation of the batch rows) computes each batch in that row order
    and puts the rows back, so a rank's result cannot depend on where a row sits."""
    out = []
    for vocab in VOCABS:
        tok = tokens(vocab)
        inv = None
        if order is not None:
            tok, inv = tok[order], torch.argsort(order)
        cases = [ngram_ids(tok, n, rows=r, seed=s) for n in NS for r in ROWS for s in SEEDS]
        cfg = NGramConfig(max_n=4, rows=None, dim=6, splits=3, seed=2**52 + 1)
        cases += list(cfg.ids(tok).values())
        for ids in cases:
            out.append((ids if inv is None else ids[inv]).flatten())
    return torch.cat(out)


def digest(ids: torch.Tensor) -> str:
    return hashlib.sha256(ids.numpy().tobytes()).hexdigest()


def run(group: comm.ProcessGroup, args: list[str]) -> None:
    """Compute, gather and compare on ``group`` (callable by battery.py); no arguments."""
    rank, size = group.rank, group.size
    torch.set_num_threads(1 + rank % 2)
    order = torch.randperm(BATCH, generator=torch.Generator().manual_seed(100 + rank))
    mine = all_ids(order)
    gathered = group.allgather(mine)  # [size, cases * BATCH * SEQ]
    for r in range(size):
        if not torch.equal(gathered[r], mine):
            differ = int((gathered[r] != mine).sum())
            raise AssertionError(f"rank {rank}: {differ} n-gram ids differ from rank {r}'s")
    print(f"rank {rank}/{size}: ok ngram ids {digest(mine)}", flush=True)


if __name__ == "__main__":  # tests may import this file for its helpers
    from tests.support.ranks.rank_main import run_main

    run_main(run)
