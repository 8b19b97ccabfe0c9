"""Read and write bounds 0, one worker: training through the cache is bit-identical to
training on the plain store (every served row, every loss, and the final rows, clocks
and optimizer state), for SGD, RowWiseAdagrad and Adam; with evictions, pass-through
rows (cache smaller than a batch), repeated ids and prefetch.

Bit for bit by design (docs/numerics.md): the cache sums a batch's repeated ids with the
store's own ``coalesce`` and, at write bound 0, pushes every row of the batch at once, so
the store gets the batch's rows with the same sums in the same sorted order as the plain
store does; at read bound 0 every reused row is refreshed from the store. Both stores
then run the same kernels on the same ``[U, D]`` tensors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cache
import ps
from tiny_hybrid import TinyHybrid, tiny_batch
from tolerance import assert_same

pytestmark = [pytest.mark.timeout(120), pytest.mark.numerics]

OPTS = {
    "sgd": ps.SGD(lr=0.1, momentum=0.9),
    "rowwise_adagrad": ps.RowWiseAdagrad(lr=0.1),
    "adam": ps.Adam(lr=0.01),
}
ROWS, DIM = 200, 8
SAME = "bounds (0, 0): the same pushes, rows in the same order, through the same kernels"


def _same_tables(a: ps.Store, b: ps.Store, table: str, rows: int) -> None:
    every = torch.arange(rows)
    assert_same(a.pull(table, every).rows, b.pull(table, every).rows, what="rows", why=SAME)
    assert torch.equal(a.clocks(table, every), b.clocks(table, every))
    assert_same(a.state(table, every), b.state(table, every), what="state", why=SAME)


@pytest.mark.parametrize("opt", list(OPTS))
@pytest.mark.parametrize(
    ("capacity", "prefetch", "verify"),
    [(20, False, True), (20, True, True), (20, True, False), (3, True, True)],
    ids=["evicting", "prefetch", "prefetch-trusted", "pass-through"],
)
def test_direct_requests_bit_identical(opt: str, capacity: int, prefetch: bool, verify: bool):
    spec = ps.TableSpec(name="t", num_rows=ROWS, dim=DIM, optimizer=OPTS[opt])
    plain, inner = ps.InProcessStore(), ps.InProcessStore()
    plain.create_table(spec)
    inner.create_table(spec)
    cfg = cache.CacheConfig(capacity_rows=capacity, verify_prefetched=verify, prefetch="on")
    store = cache.CachedStore(inner, cfg)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 40, (12,), generator=g) ** 2 % ROWS for _ in range(41)]
    for step in range(40):
        ids = batches[step]  # repeats and unsorted order on purpose
        got, want = store.pull("t", ids), plain.pull("t", ids)
        assert_same(got.rows, want.rows, what=f"step {step} rows", why=SAME)
        if prefetch:
            store.prefetch("t", batches[step + 1])
        grads = torch.randn(ids.numel(), DIM, generator=g)
        store.push("t", ids, grads)
        plain.push("t", ids, grads)
    store.flush()
    _same_tables(inner, plain, "t", ROWS)
    st = store.cache_stats()["t"]
    assert st["staleness_served"] == {0: st["lookups"]}
    if capacity == 3:  # every slot holds a row of the current batch: prefetch cannot admit
        assert st["pass_through"] > 0
    else:
        assert st["evictions"] > 0
        assert st["prefetched"] > 0 or not prefetch


@pytest.mark.parametrize("opt", list(OPTS))
def test_embedding_collection_training_bit_identical(opt: str) -> None:
    """EmbeddingCollection + a linear top on a cache of ~10 % of the rows with prefetch of
    the next batch between forward and backward, against the same model on the plain store."""
    plain = TinyHybrid(ps.InProcessStore(), OPTS[opt])
    cached_store = cache.CachedStore(
        ps.InProcessStore(), cache.CacheConfig(capacity_fraction=0.1, policy="lfu")
    )
    cached = TinyHybrid(cached_store, OPTS[opt])
    opts = [torch.optim.SGD(m.top.parameters(), lr=0.1) for m in (plain, cached)]
    g = torch.Generator().manual_seed(1)
    batches = [tiny_batch(g) for _ in range(21)]
    for step in range(20):
        kjt, labels = batches[step]
        losses = []
        for m, o in zip((plain, cached), opts, strict=True):
            loss = F.binary_cross_entropy_with_logits(m(kjt), labels)
            if m is cached:
                nxt = batches[step + 1][0]
                cached_store.prefetch("user", nxt.key_slice("user").ids)
                cached_store.prefetch(
                    "item", torch.cat([nxt.key_slice("item").ids, nxt.key_slice("hist").ids])
                )
            o.zero_grad()
            loss.backward()
            o.step()
            losses.append(loss.detach())
        # The same served rows through the same modules (same seeds, same ops): same loss.
        assert_same(losses[1], losses[0], what=f"step {step} loss", why=SAME)
    cached_store.flush()
    _same_tables(cached_store.inner, plain.emb.store, "user", 300)
    _same_tables(cached_store.inner, plain.emb.store, "item", 500)
    assert_same(cached.top.weight, plain.top.weight, what="top weight", why=SAME)
    st = cached_store.cache_stats()
    # At read bound 0 every row pushed last step is stale when reused: refreshes, no hits.
    assert st["item"]["evictions"] > 0 and st["item"]["refreshes"] > 0
