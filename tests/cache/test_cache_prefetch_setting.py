"""Whether a cache fetches announced batches ahead (``CacheConfig.prefetch``).

By default (``"auto"``) it does not, in front of any store: a prefetch riding on the
current pull hides no latency and plans each batch twice; ``"on"`` turns it on.
Reference: the plain store fed the same requests (bounds (0, 0), one worker: bit for
bit with and without prefetching, as ``test_cache_groups`` argues); a prefetch that
fetches nothing still checks its ids.
"""

from __future__ import annotations

import pytest
import torch

import cache
import ps
from hybridrec.dlrm.config import DLRMJobConfig
from hybridrec.launch.job_cache import cache_config
from ps import PullRequest, PushRequest
from tolerance import assert_same
from wrapped_store import WrappedStore

pytestmark = [pytest.mark.timeout(60), pytest.mark.numerics]

DIM = 4
ROWS = {"a": 60, "b": 90}
SAME = "bounds (0, 0): every reused row is refreshed, the pushes are the plain store's"


def _specs() -> list[ps.TableSpec]:
    opt = ps.RowWiseAdagrad(lr=0.1)
    return [ps.TableSpec(name=n, num_rows=r, dim=DIM, optimizer=opt) for n, r in ROWS.items()]


def _batches(steps: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    # skewed ids with repeats, unsorted: squares of small numbers modulo the rows
    return [
        {n: torch.randint(0, 12, (9,), generator=g) ** 2 % r for n, r in ROWS.items()}
        for _ in range(steps)
    ]


def test_auto_does_not_prefetch_in_front_of_any_store() -> None:
    def prefetching(store: ps.Store, mode: str) -> bool:
        cfg = cache.CacheConfig(capacity_rows=4, prefetch=mode)  # type: ignore[arg-type]
        return cache.CachedStore(store, cfg).prefetching

    assert not prefetching(ps.InProcessStore(), "auto")
    assert not prefetching(WrappedStore(), "auto")  # a store of unknown latency
    assert prefetching(ps.InProcessStore(), "on")
    assert prefetching(WrappedStore(), "on")
    assert not prefetching(WrappedStore(), "off")


def test_config_names_a_bad_prefetch_value() -> None:
    with pytest.raises(ValueError, match=r"prefetch must be one of .*'auto'.* got 'sometimes'"):
        cache.CacheConfig(capacity_rows=4, prefetch="sometimes")  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["auto", "on", "off"])
@pytest.mark.parametrize("policy", ["lru", "tinylfu"])
def test_served_rows_are_the_plain_stores_with_and_without_prefetch(mode: str, policy: str) -> None:
    plain, inner = ps.InProcessStore(), ps.InProcessStore()
    for spec in _specs():
        plain.create_table(spec)
        inner.create_table(spec)
    cfg = cache.CacheConfig(
        capacity_rows=8,
        policy=policy,
        group_tables=True,
        prefetch=mode,  # type: ignore[arg-type]
    )
    store = cache.CachedStore(inner, cfg)
    batches = _batches(31)
    g = torch.Generator().manual_seed(6)
    for step in range(30):
        ids = batches[step]
        store.prefetch_many([PullRequest(n, i) for n, i in batches[step + 1].items()])
        grads = {n: torch.randn(i.numel(), DIM, generator=g) for n, i in ids.items()}
        got = store.pull_many([PullRequest(n, i) for n, i in ids.items()])
        want = plain.pull_many([PullRequest(n, i) for n, i in ids.items()])
        for n, a, b in zip(ids, got, want, strict=True):
            assert_same(a.rows, b.rows, what=f"step {step} {n} rows", why=SAME)
        store.push_many([PushRequest(n, i, grads[n]) for n, i in ids.items()])
        plain.push_many([PushRequest(n, i, grads[n]) for n, i in ids.items()])
    store.flush()
    for n, r in ROWS.items():
        every = torch.arange(r)
        assert_same(inner.pull(n, every).rows, plain.pull(n, every).rows, what=n, why=SAME)
        assert torch.equal(inner.clocks(n, every), plain.clocks(n, every)), n
    (st,) = store.cache_stats().values()
    assert st["evictions"] + st["rejected"] > 0, st  # the cache was full: admission decided
    assert (st["prefetched"] > 0) == (mode == "on"), st


@pytest.mark.parametrize("mode", ["on", "off"])
def test_a_prefetch_checks_its_ids_whether_or_not_it_fetches(mode: str) -> None:
    inner = ps.InProcessStore()
    for spec in _specs():
        inner.create_table(spec)
    cfg = cache.CacheConfig(capacity_rows=8, group_tables=True, prefetch=mode)  # type: ignore[arg-type]
    store = cache.CachedStore(inner, cfg)
    with pytest.raises(ValueError, match=r"'b'.*90"):
        store.prefetch_many(
            [PullRequest("a", torch.tensor([1])), PullRequest("b", torch.tensor([90]))]
        )
    with pytest.raises(ValueError, match=r"'a'.*-1"):
        store.prefetch("a", torch.tensor([-1]))
    before = inner.pull("a", torch.arange(ROWS["a"])).rows
    got = store.pull("a", torch.tensor([1, 2]))  # nothing was left half done
    assert torch.equal(got.rows, before[[1, 2]])


@pytest.mark.parametrize("mode", ["auto", "on", "off"])
def test_the_jobs_cache_prefetch_option_reaches_the_cache(mode: str) -> None:
    spec = ps.TableSpec(name="t", num_rows=10, dim=DIM, optimizer=ps.SGD(lr=0.1))
    job = DLRMJobConfig(cache_rows=5, cache_prefetch=mode)  # type: ignore[arg-type]
    got = cache_config(job, [spec], torch.device("cpu"))
    assert got is not None and got.prefetch == mode
    assert DLRMJobConfig(cache_rows=5).cache_prefetch == "auto"


@pytest.mark.parametrize("mode", ["auto", "gradients", "values"])
def test_the_jobs_write_back_option_reaches_the_cache(mode: str) -> None:
    spec = ps.TableSpec(name="t", num_rows=10, dim=DIM, optimizer=ps.SGD(lr=0.1))
    job = DLRMJobConfig(cache_rows=5, cache_write_back=mode)  # type: ignore[arg-type]
    got = cache_config(job, [spec], torch.device("cpu"))
    assert got is not None and got.write_back == mode
    assert DLRMJobConfig(cache_rows=5).cache_write_back == "auto"
