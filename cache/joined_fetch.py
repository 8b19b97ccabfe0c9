"""A serving pull and the prefetch that rides on it, asked of the store as ONE request.

A cache's step asks the store for the rows of this batch (misses, and copies past the
read bound: a conditional pull) and of the next batch (its misses: usually a plain
pull), in one batched message. Sent as two requests per table, every store pays its
per-request work twice per table, and Redis twice per bucket (an HMGET of the rows
and one of the state for each). Both come from one cache, so their ids are sorted and
disjoint (the prefetch leaves out the pull's ids) and want the same columns; joined,
they are one sorted request and one reply, split back here.

A plain part joins a conditional one with the caller clock ``-1 - bound`` for each of
its ids: a row's clock is >= 0, so the store sends every one of them, as a plain pull
would. Example (bound 4)::

    pull     ids [3, 9]   clocks [7, -5]        conditional
    prefetch ids [5, 12]                        plain
    joined   ids [3, 5, 9, 12]  clocks [7, -5, -5, -5]  is_second [F, T, F, T]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ps import PullRequest, PullResult


@dataclass(frozen=True, slots=True, eq=False)
class Joined:
    """Where each id of a joined request came from: ``second`` ``[N]`` bool (the second
    request's), ``own`` ``[N]`` its index in its own request; whether each request was
    conditional (its result carries positions)."""

    second: np.ndarray
    own: np.ndarray
    conditional: tuple[bool, bool]

    def split(self, result: PullResult) -> tuple[PullResult, PullResult]:
        """The results of the two requests from the joined request's ``result``."""
        if result.positions is None:  # both plain: every row, in the joined order
            at = np.arange(self.second.size)
        else:
            at = result.positions.numpy()  # [M] indices into the joined ids
        second = self.second.take(at)  # [M]
        own = self.own.take(at)  # [M]
        return self._part(result, ~second, own, 0), self._part(result, second, own, 1)

    def _part(self, result: PullResult, mine: np.ndarray, own: np.ndarray, k: int) -> PullResult:
        # The joined rows of either request keep their own order (both ran increasing).
        sel = torch.from_numpy(np.flatnonzero(mine))  # [M_k]
        state = None if result.state is None else result.state.index_select(0, sel)
        positions = torch.from_numpy(own[mine]) if self.conditional[k] else None
        return PullResult(
            result.rows.index_select(0, sel), result.clocks.index_select(0, sel), positions, state
        )


def join(first: PullRequest, second: PullRequest) -> tuple[PullRequest, Joined] | None:
    """One request for both (increasing, disjoint ids of one table, the same columns),
    and how to split its reply; None where they cannot be one (bounds that differ)."""
    if first.table != second.table or first.with_state != second.with_state:
        return None
    bounds = {r.bound for r in (first, second) if r.bound is not None}
    if len(bounds) > 1:
        return None
    a, b = first.ids.numpy(), second.ids.numpy()
    # Merge of two sorted runs: b[j] lands after the j ids of b before it and the ids of
    # a below it.
    at_b = np.searchsorted(a, b) + np.arange(b.size)  # [B] joined positions of b's ids
    n = a.size + b.size
    is_second = np.zeros(n, dtype=bool)
    is_second[at_b] = True
    own = np.empty(n, dtype=np.int64)
    own[~is_second] = np.arange(a.size)
    own[at_b] = np.arange(b.size)
    ids = np.empty(n, dtype=np.int64)
    ids[~is_second], ids[at_b] = a, b
    clocks = bound = None
    if bounds:
        bound = bounds.pop()
        fill = -1 - bound  # every row's clock is past fill + bound
        clocks = np.full(n, fill, dtype=np.int64)
        for r, where in ((first, ~is_second), (second, is_second)):
            if r.clocks is not None:
                clocks[where] = r.clocks.numpy()
    joined = PullRequest(
        first.table,
        torch.from_numpy(ids),
        None if clocks is None else torch.from_numpy(clocks),
        bound,
        first.with_state,
    )
    conditional = (first.bound is not None, second.bound is not None)
    return joined, Joined(is_second, own, conditional)
