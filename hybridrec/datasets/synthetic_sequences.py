"""Synthetic user histories: Zipf-popular items with a learnable next-item structure.

For benchmarks at catalogue sizes no shipped data set has (a million items). Each
user's history starts at a Zipf(``zipf``)-popular item; each next item is, with
probability ``follow``, the previous item's fixed successor (a random permutation of
the catalogue: the sequential signal a model can learn), else a fresh Zipf draw (the
popularity a baseline sees). Lengths are 3 + Poisson(``length`` - 3); timestamps grow
by a random gap of up to a day per interaction. Deterministic per ``seed``.
"""

from __future__ import annotations

import numpy as np

from hybridrec.datasets.sequences import SequenceData


def zipf_items(rng: np.random.Generator, n: int, items: int, zipf: float) -> np.ndarray:
    """``n`` item ids in ``[0, items)`` with P(rank r) proportional to ``(r + 1) ** -zipf``,
    the popularity ranks scattered over the ids by a fixed permutation."""
    weights = np.arange(1, items + 1, dtype=np.float64) ** -zipf
    cdf = np.cumsum(weights)
    ranks = np.searchsorted(cdf, rng.random(n) * cdf[-1], side="right")
    return np.minimum(ranks, items - 1).astype(np.int64)


def synthetic_sequences(
    *, items: int, users: int, length: int, zipf: float, seed: int, follow: float = 0.5
) -> SequenceData:
    """``users`` histories over ``items`` items (module docstring)."""
    if items < 2 or users < 1 or length < 3:
        raise ValueError(
            f"synthetic sequences need items >= 2, users >= 1 and length >= 3, got "
            f"items {items}, users {users}, length {length}"
        )
    rng = np.random.Generator(np.random.PCG64(seed))
    successor = rng.permutation(items).astype(np.int64)  # [V]: each item's usual next item
    lengths = 3 + rng.poisson(max(length - 3, 0), users).astype(np.int64)  # [U]
    offsets = np.zeros(users + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    n = int(offsets[-1])
    out = zipf_items(rng, n, items, zipf)  # [N]: a fresh draw at every position ...
    follows = rng.random(n) < follow  # ... kept where the history does not follow
    starts = np.zeros(n, dtype=bool)
    starts[offsets[:-1]] = True
    follows &= ~starts
    # Position by position (histories are short): a following item is the successor of
    # the item before it, whatever that one turned out to be.
    position = np.arange(n) - np.repeat(offsets[:-1], lengths)  # [N] index within the user
    for p in range(1, int(lengths.max())):
        at = np.flatnonzero((position == p) & follows)
        out[at] = successor[out[at - 1]]
    gaps = rng.integers(1, 86_400, n, dtype=np.int64)
    gaps[offsets[:-1]] = 1_600_000_000  # every user starts at the same epoch second
    times = np.cumsum(gaps) - np.repeat(np.cumsum(gaps)[offsets[:-1]] - 1_600_000_000, lengths)
    return SequenceData(
        items=out,
        times=times.astype(np.int64),
        offsets=offsets,
        user_vocab=[str(u) for u in range(users)],
        item_vocab=[str(i) for i in range(items)],
        source=f"synthetic ({users} users, {items} items, {n} interactions, Zipf {zipf})",
    )
