"""Group requests through the cache (``CachedStore.pull_groups_async`` /
``push_groups_async``): a lone group request over exactly one shared cache's id space
(what the hybrid tables send for a dim group of fixed tables) is that cache's ask as it
comes, its packed ids not cut by table nor packed again.

Reference: a second cache over an identical store fed the same rows as per-table
requests (``pull_many`` / ``push_many``), which pack them into the same ids: the same
cache code then runs on the same ids and gradients, so served rows, statistics and the
store's rows, clocks and state must be equal bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import cache
import ps
from cache.table_group import TableGroup
from ps import PullRequest, PushRequest
from ps.group_requests import GroupPull, GroupPush, IdSpace
from tiny_hybrid import TinyHybrid, tiny_batch
from tolerance import assert_same

pytestmark = pytest.mark.timeout(60)

DIM = 4
ROWS = {"a": 60, "b": 90}
SPACE = IdSpace(("a", "b"), np.array([0, 60, 150], dtype=np.int64))
SAME = "the same cache code on the same packed ids and gradients"


def _stores(bounds: tuple[int, int], policy: str) -> tuple[cache.CachedStore, ps.InProcessStore]:
    inner = ps.InProcessStore()
    for name, rows in ROWS.items():
        inner.create_table(
            ps.TableSpec(name=name, num_rows=rows, dim=DIM, optimizer=ps.RowWiseAdagrad(lr=0.1))
        )
    cfg = cache.CacheConfig(
        capacity_rows=6, group_tables=True, read_bound=bounds[0], write_bound=bounds[1],
        policy=policy, evict_chunk=1,
    )  # fmt: skip
    return cache.CachedStore(inner, cfg), inner


def _steps(n: int, seed: int) -> list[torch.Tensor]:
    """Per step the sorted distinct packed ids of both tables (skewed, so rows repeat
    across steps and the small cache evicts)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        a = torch.randint(0, 12, (9,), generator=g) ** 2 % ROWS["a"]
        b = torch.randint(0, 12, (9,), generator=g) ** 2 % ROWS["b"] + ROWS["a"]
        out.append(torch.unique(torch.cat([a, b])))
    return out


def _per_table(packed: torch.Tensor) -> dict[str, torch.Tensor]:
    cut = int(torch.searchsorted(packed, ROWS["a"]))
    return {"a": packed[:cut], "b": packed[cut:] - ROWS["a"]}


@pytest.mark.parametrize("policy", ["lru", "tinylfu"])
@pytest.mark.parametrize("bounds", [(0, 0), (2, 3)])
def test_group_requests_equal_the_per_table_requests(
    bounds: tuple[int, int], policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    grouped, grouped_inner = _stores(bounds, policy)
    plain, plain_inner = _stores(bounds, policy)
    steps = _steps(25, seed=5)
    g = torch.Generator().manual_seed(6)
    grads = [torch.randn(p.numel(), DIM, generator=g) for p in steps]
    for k, (packed, grad) in enumerate(zip(steps, grads, strict=True)):
        ids = _per_table(packed)
        want = plain.pull_many([PullRequest(n, i) for n, i in ids.items()])
        na = ids["a"].numel()
        plain.push_many(
            [PushRequest("a", ids["a"], grad[:na]), PushRequest("b", ids["b"], grad[na:])]
        )
        with monkeypatch.context() as m:  # the group's ids are never packed again
            m.setattr(TableGroup, "pack_many", _never)
            (got,) = grouped.pull_groups_async([GroupPull(SPACE, packed)]).wait()
            grouped.push_groups_async([GroupPush(SPACE, packed, grad)]).wait()
        assert_same(got.rows, torch.cat([w.rows for w in want]), what=f"step {k} rows", why=SAME)
        assert torch.equal(got.clocks, torch.cat([w.clocks for w in want])), k
    assert grouped.cache_stats() == plain.cache_stats()
    grouped.flush()
    plain.flush()
    for name, rows in ROWS.items():
        every = torch.arange(rows)
        assert_same(grouped_inner.pull(name, every).rows, plain_inner.pull(name, every).rows,
                    what=name, why=SAME)  # fmt: skip
        assert torch.equal(grouped_inner.clocks(name, every), plain_inner.clocks(name, every))
        assert_same(grouped_inner.state(name, every), plain_inner.state(name, every),
                    what=f"{name} state", why=SAME)  # fmt: skip


def _never(*args: object, **kwargs: object) -> None:
    raise AssertionError("a group request over the cache's own space was packed again")


@pytest.mark.parametrize(
    "bad, words",
    [
        ("nan", ["'b'", "row id 4", "NaN or Inf", "nothing was applied"]),
        ("outside", ["a+b", "packed id 150", "outside [0, 150)"]),
        ("float64", ["'a'", "float32", "float64"]),
    ],
)
def test_a_bad_group_push_is_named_by_table_and_applies_nothing(bad: str, words: list[str]) -> None:
    store, inner = _stores((2, 3), "lru")
    ref, _ = _stores((2, 3), "lru")
    packed = torch.tensor([1, 4, 9, 64, 69])  # a: 1, 4, 9; b: 4, 9
    for s in (store, ref):  # the rows cached, with pending updates
        s.pull_groups_async([GroupPull(SPACE, packed)]).wait()
        s.push_groups_async([GroupPush(SPACE, packed, torch.ones(5, DIM))]).wait()
    grads, ids = torch.full((5, DIM), 0.5), packed
    if bad == "nan":
        grads[3, 1] = float("nan")  # table b's id 4
    elif bad == "outside":
        ids = torch.tensor([1, 4, 9, 64, 150])
    else:
        grads = grads.double()
    with pytest.raises((ValueError, TypeError)) as err:
        store.push_groups_async([GroupPush(SPACE, ids, grads)]).wait()
    for w in words:
        assert w in str(err.value), (w, str(err.value))
    (got,) = store.pull_groups_async([GroupPull(SPACE, packed)]).wait()
    (want,) = ref.pull_groups_async([GroupPull(SPACE, packed)]).wait()
    assert_same(got.rows, want.rows, what="rows after the refused push", why=SAME)
    assert store.cache_stats() == ref.cache_stats()


def test_a_group_request_over_another_space_is_cut_by_table() -> None:
    """Only a's rows, or b before a: not the shared cache's space, so the request is cut
    into its tables' requests and served as those would be."""
    store, _ = _stores((2, 3), "lru")
    ref, _ = _stores((2, 3), "lru")
    both = torch.tensor([1, 4, 64, 69])
    for s in (store, ref):  # the shared cache is made for a and b, in that order
        s.pull_groups_async([GroupPull(SPACE, both)]).wait()
    only_a = IdSpace(("a",), np.array([0, 60], dtype=np.int64))
    b_then_a = IdSpace(("b", "a"), np.array([0, 90, 150], dtype=np.int64))
    (got_a,) = store.pull_groups_async([GroupPull(only_a, torch.tensor([1, 4, 7]))]).wait()
    (got_ba,) = store.pull_groups_async([GroupPull(b_then_a, torch.tensor([4, 91]))]).wait()
    want = ref.pull_many([PullRequest("a", torch.tensor([1, 4, 7]))])[0]
    assert_same(got_a.rows, want.rows, what="a's rows", why=SAME)
    want_b, want_a = ref.pull_many(
        [PullRequest("b", torch.tensor([4])), PullRequest("a", torch.tensor([1]))]
    )
    assert_same(got_ba.rows, torch.cat([want_b.rows, want_a.rows]), what="b, a rows", why=SAME)


@pytest.mark.parametrize("bounds", [(0, 0), (2, 3)])
def test_hybrid_tables_train_the_same_through_their_group_requests(
    bounds: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model on two hybrid tables of one dim behind a shared cache: its group requests
    taken as they come (never packed again) against the same model whose requests the
    cache cuts by table and packs (the route of any other request): the same cache code
    on the same ids and gradients, so every loss and the final store bit for bit."""

    def model() -> tuple[TinyHybrid, cache.CachedStore, torch.optim.Optimizer]:
        cfg = cache.CacheConfig(
            capacity_fraction=0.1, group_tables=True, read_bound=bounds[0],
            write_bound=bounds[1],
        )  # fmt: skip
        store = cache.CachedStore(ps.InProcessStore(), cfg)
        m = TinyHybrid(store, ps.RowWiseAdagrad(lr=0.1))
        return m, store, torch.optim.SGD(m.top.parameters(), lr=0.1)

    fast, fast_store, fast_opt = model()
    cut, cut_store, cut_opt = model()
    g = torch.Generator().manual_seed(3)
    for step in range(15):
        kjt, labels = tiny_batch(g)
        losses = []
        for m, opt, route in ((fast, fast_opt, "fast"), (cut, cut_opt, "cut")):
            with monkeypatch.context() as patch:
                if route == "fast":
                    patch.setattr(TableGroup, "pack_many", _never)
                else:  # no cache's space matches: cut by table
                    patch.setattr(cache.CachedStore, "_cache_of_space", lambda *a: None)
                loss = F.binary_cross_entropy_with_logits(m(kjt), labels)
                opt.zero_grad()
                loss.backward()
                opt.step()
            losses.append(loss.detach())
        assert_same(losses[0], losses[1], what=f"step {step} loss", why=SAME)
    assert fast_store.cache_stats() == cut_store.cache_stats()
    assert fast_store.cache_stats()["user+item"]["evictions"] > 0
    for s in (fast_store, cut_store):
        s.flush()
    for name, rows in (("user", 300), ("item", 500)):
        every = torch.arange(rows)
        a, b = fast_store.inner, cut_store.inner
        assert_same(a.pull(name, every).rows, b.pull(name, every).rows, what=name, why=SAME)
        assert torch.equal(a.clocks(name, every), b.clocks(name, every))
        assert_same(a.state(name, every), b.state(name, every), what=f"{name} state", why=SAME)
