"""Prefetch: the next batch's pull runs while this batch computes, so a step takes about
max(compute, pull) instead of their sum; prefetched rows are counted as moved, not as hits.

The slow store is a real ``ps.Store``: an InProcessStore whose pull replies arrive
``delay`` seconds after the request, like a remote parameter server's."""

from __future__ import annotations

import statistics
import time

import pytest
import torch

import cache
import ps
from comm import Handle
from tolerance import assert_same
from wrapped_store import WrappedStore

pytestmark = pytest.mark.timeout(120)

DIM = 4


class SlowStore(WrappedStore):
    """``InProcessStore`` with ``delay`` seconds of latency on every pull reply."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay
        self.pulls = 0

    def pull_async(
        self,
        table: str,
        ids: torch.Tensor,
        *,
        clocks: torch.Tensor | None = None,
        bound: int | None = None,
    ) -> Handle:
        self.pulls += 1
        result = self.inner.pull(table, ids, clocks=clocks, bound=bound)
        ready = time.monotonic() + self.delay

        def block(limit: float) -> None:
            time.sleep(max(0.0, ready - time.monotonic()))

        return Handle(
            lambda: time.monotonic() >= ready,
            lambda: result,
            what="slow pull",
            timeout_s=30.0,
            block=block,
        )


def _cached(delay: float, **kw: object) -> tuple[cache.CachedStore, SlowStore]:
    slow = SlowStore(delay)
    slow.create_table(ps.TableSpec(name="t", num_rows=100, dim=DIM, optimizer=ps.SGD(lr=0.1)))
    kw.setdefault("prefetch", "on")  # the prefetch is what these tests are about
    cfg = cache.CacheConfig(capacity_rows=50, **kw)  # type: ignore[arg-type]
    return cache.CachedStore(slow, cfg), slow


@pytest.mark.timeout(60)
def test_prefetch_overlaps_pull_with_compute() -> None:
    delay = compute = 0.25
    # Two disjoint id sets in turn: the rows a prefetch brings were not pushed since.
    batches = [torch.arange(0, 20), torch.arange(20, 40)]
    step_times: dict[bool, list[float]] = {}
    for prefetch in (False, True):
        store, _ = _cached(delay, verify_prefetched=False)
        times = []
        for step in range(6):
            t0 = time.perf_counter()
            ids = batches[step % 2]
            rows = store.pull("t", ids).rows
            if prefetch:
                store.prefetch("t", batches[(step + 1) % 2])
            time.sleep(compute)  # forward + backward
            store.push("t", ids, torch.ones_like(rows))
            times.append(time.perf_counter() - t0)
        step_times[prefetch] = times[2:]  # after the first prefetch took effect
    plain, overlapped = (statistics.median(step_times[p]) for p in (False, True))
    assert plain > delay + compute - 0.02, step_times
    assert overlapped < max(delay, compute) + 0.12, step_times
    assert overlapped < 0.75 * plain, step_times


def test_prefetched_rows_count_as_moved_not_as_hits() -> None:
    for verify, requests in ((True, 2), (False, 1)):
        store, slow = _cached(0.0, verify_prefetched=verify)
        ids = torch.tensor([1, 2, 3])
        store.prefetch("t", ids)
        store.pull("t", ids)
        st = store.cache_stats()["t"]
        assert (st["misses"], st["prefetched"], st["hits"]) == (3, 3, 0)
        # verify: the pull still asks the PS (one conditional request; nothing came back)
        assert slow.pulls == st["pull_requests"] == requests and st["rows_pulled"] == 3
        store.pull("t", ids)  # now a real hit
        assert store.cache_stats()["t"]["hits"] == 3


def test_prefetch_then_push_first_keeps_order() -> None:
    """A push before the prefetched pull: the prefetch is installed first, then the update."""
    store, slow = _cached(0.0, read_bound=0, write_bound=3)
    ref = ps.InProcessStore()
    ref.create_table(slow.spec("t"))
    ids = torch.tensor([5, 6])
    store.pull("t", ids)
    store.prefetch("t", torch.tensor([6, 7]))
    g = torch.full((2, DIM), 0.5)
    store.push("t", ids, g)  # cached: pending, copies take an SGD step
    rows = store.pull("t", torch.tensor([6, 7])).rows
    want = ref.pull("t", torch.tensor([6, 7])).rows
    want[0] -= 0.1 * 0.5
    # The copy's step float32(0.1) * 0.5 (a halving: exact) is float32(0.05), which the
    # reference subtracts: the same float32 subtraction, rounded once.
    assert_same(rows, want, what="served rows", why="one subtraction of the same float32 step")
    store.flush()
    ref.push("t", ids, g)
    assert_same(
        slow.pull("t", torch.arange(10)).rows,
        ref.pull("t", torch.arange(10)).rows,
        what="store rows",
        why="one push of the same rows and gradients through the same store kernel",
    )


@pytest.mark.parametrize("policy", ["lru", "lfu", "tinylfu"])
def test_a_full_cache_prefetches_only_the_misses_it_has_room_for(policy: str) -> None:
    """A prefetch riding on a serving pull that uses most of a full cache asks the store
    only for the misses the rest of the cache can take: the serving pull's cached rows are
    in use from its plan on, so no victim search, and no count of room, takes them.

    50 slots, all cached; the serving pull reads 40 of them, the prefetch asks for 30 rows
    not cached: 10 slots can take them (the 10 cached rows the batch does not read), so
    LRU and LFU fetch 10 rows and keep them, none fetched in vain; TinyLFU fetches only
    those of the 10 whose estimate beats their victim's, and keeps them."""
    inner = ps.InProcessStore()
    inner.create_table(ps.TableSpec(name="t", num_rows=100, dim=DIM, optimizer=ps.SGD(lr=0.1)))
    store = cache.CachedStore(
        inner, cache.CacheConfig(capacity_rows=50, policy=policy, prefetch="on", evict_chunk=1)
    )
    store.pull("t", torch.arange(0, 50))  # fills the cache
    pulled = inner.stats()["t"]["rows_pulled"]
    store.prefetch_many([ps.PullRequest("t", torch.arange(50, 80))])  # rides on the next pull
    store.pull("t", torch.arange(0, 40))  # and the prefetch, in the same request
    # the serving pull's 40 cached rows are current (bounds: nothing pushed): not sent back
    fetched = inner.stats()["t"]["rows_pulled"] - pulled
    assert (fetched == 10) if policy != "tinylfu" else (0 < fetched <= 10), policy
    kept = store.pull("t", torch.arange(50, 80))  # installs the prefetch first
    st = store.cache_stats()["t"]
    assert st["prefetched"] == fetched and st["cached_rows"] == 50  # every row fetched kept
    assert_same(kept.rows, inner.pull("t", torch.arange(50, 80)).rows, what="rows", why="no push")
