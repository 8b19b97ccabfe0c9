"""Ids per step, sampled from the id law, and the cache's traffic, simulated.

The planner never uses a closed formula for distinct ids or hit rates (one that ignores
skew is badly wrong on a Zipf law): it draws the ids of a worker's steps and counts.

* :class:`ZipfSampler`: rank ``k`` (1-based) of a table of ``R`` rows with probability
  ``k**-a / H``; the first 2**20 ranks from the exact CDF, the tail by inverting the
  integral of ``x**-a`` (a huge table needs no ``[R]`` array). Only distinctness
  matters here, so ranks stand for ids (no scatter over the id range).
* :class:`FileSampler`: the ids of a data file, a step being ``draws`` rows picked at
  random (with replacement) from the file.
* :func:`simulate_table`: one worker's steps through the hot-row cache (LFU or LRU,
  capacity, read and write bounds), counting what the cache asks the PS, what comes
  back, what it pushes; other workers' pushes make copies stale at the rate their
  batches touch the row (``(W - 1) * P(row in a batch) / (s_w + 1)`` per step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hybridrec.plan.spec import CachePlan, IdLaw, Plan, TablePlan

HEAD = 1 << 20  # ranks drawn from the exact CDF
TRACKED = 1 << 22  # ranks the cache simulation tracks; rarer ones are always misses


class ZipfSampler:
    """Draws ranks in ``[0, rows)`` (0 = most popular) from Zipf(``a``); ``a`` 0: uniform."""

    def __init__(self, rows: int, a: float) -> None:
        if rows < 1:
            raise ValueError(f"ZipfSampler: rows must be >= 1, got {rows}")
        self.rows, self.a = rows, float(a)
        head = min(rows, HEAD)
        w = np.arange(1, head + 1, dtype=np.float64) ** -self.a  # [head]
        tail = self._tail_mass(head + 0.5, rows + 0.5) if rows > head else 0.0
        total = w.sum() + tail
        self.head_cdf = np.cumsum(w) / total  # [head]
        self.head_p = w / total
        self.head, self.total = head, total

    def _integral(self, x: float) -> float:
        """``∫ x**-a dx`` antiderivative."""
        a = self.a
        return math.log(x) if a == 1.0 else x ** (1.0 - a) / (1.0 - a)

    def _tail_mass(self, lo: float, hi: float) -> float:
        return self._integral(hi) - self._integral(lo)

    def _tail_inverse(self, mass: np.ndarray) -> np.ndarray:
        """Ranks (0-based) whose tail integral from ``head + 0.5`` equals ``mass``."""
        a, lo = self.a, self.head + 0.5
        if a == 1.0:
            x = lo * np.exp(mass)
        else:
            x = (lo ** (1.0 - a) + (1.0 - a) * mass) ** (1.0 / (1.0 - a))
        return np.minimum(np.floor(x - 0.5).astype(np.int64), self.rows - 1)

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` int64 ranks."""
        u = rng.random(n)  # [n]
        ranks = np.searchsorted(self.head_cdf, u, side="right").astype(np.int64)
        in_tail = ranks >= self.head
        if in_tail.any():
            mass = (u[in_tail] - self.head_cdf[-1]) * self.total
            ranks[in_tail] = self._tail_inverse(mass)
        return np.minimum(ranks, self.rows - 1)

    def touch_probability(self, draws: int, ranks: np.ndarray) -> np.ndarray:
        """P(rank drawn at least once in ``draws`` draws), for ``ranks`` [n]."""
        p = np.where(
            ranks < self.head,
            self.head_p[np.minimum(ranks, self.head - 1)],
            (ranks + 1.0) ** -self.a / self.total,
        )
        return -np.expm1(draws * np.log1p(-np.minimum(p, 1 - 1e-12)))


class FileSampler:
    """Ranks from a data file's ids of one table: ids are renumbered by frequency (0 =
    most frequent); a step draws random rows of the file."""

    def __init__(self, ids: np.ndarray, what: str) -> None:
        ids = np.asarray(ids).reshape(-1)
        if ids.size == 0:
            raise ValueError(f"{what}: no ids")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"{what}: ids must be integers, got dtype {ids.dtype}")
        values, inverse, counts = np.unique(ids, return_inverse=True, return_counts=True)
        order = np.argsort(-counts, kind="stable")
        rank_of = np.empty_like(order)
        rank_of[order] = np.arange(order.size)
        self.ranks = rank_of[inverse].astype(np.int64)  # [N] each sample's rank
        self.p = counts[order] / ids.size  # [V] probability of each rank
        self.rows = int(values.size)

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return self.ranks[rng.integers(0, self.ranks.size, n)]

    def touch_probability(self, draws: int, ranks: np.ndarray) -> np.ndarray:
        p = self.p[np.minimum(ranks, self.p.size - 1)]
        return -np.expm1(draws * np.log1p(-np.minimum(p, 1 - 1e-12)))


Sampler = ZipfSampler | FileSampler


def load_id_file(path: str, table_names: list[str]) -> dict[str, np.ndarray]:
    """``{table: ids [N]}`` from ``.npy`` ``[N, T]`` (columns in table order) or ``.npz``
    (one array per table name)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"ids file {path!r} not found")
    if p.suffix == ".npz":
        with np.load(p, allow_pickle=False) as z:
            missing = [n for n in table_names if n not in z.files]
            if missing:
                raise ValueError(f"ids file {path!r} lacks tables {missing}; it has {z.files}")
            return {n: np.asarray(z[n]) for n in table_names}
    if p.suffix == ".npy":
        a = np.load(p, allow_pickle=False)
        if a.ndim != 2 or a.shape[1] != len(table_names):
            raise ValueError(
                f"ids file {path!r}: expected [N, {len(table_names)}] (one column per table "
                f"{table_names}), got shape {list(a.shape)}"
            )
        return {n: a[:, i] for i, n in enumerate(table_names)}
    raise ValueError(f"ids file {path!r}: expected a .npy or .npz file, got {p.suffix!r}")


@dataclass(frozen=True, slots=True)
class TableTraffic:
    """One worker's per-step work on one table (means over the simulated steps).

    ``pulled`` rows come back from plain pulls (without a cache: every distinct id;
    with one: the prefetch's misses); ``asked`` ids go out in the cache's conditional
    pull (the serving pull asks for every id of the batch with its copy's clock) and
    ``refreshed`` of them come back; ``pushed`` rows go out. ``*_requests``: this
    table's requests per step of each kind."""

    lookups: float
    unique: float
    pulled: float
    asked: float
    refreshed: float
    pushed: float
    hit_rate: float
    pull_requests: float
    check_requests: float
    push_requests: float

    @property
    def returned(self) -> float:
        return self.pulled + self.refreshed


def uncached_traffic(sampler: Sampler, draws: int, steps: int, seed: int) -> TableTraffic:
    rng = np.random.default_rng(seed)
    unique = float(np.mean([np.unique(sampler.draw(rng, draws)).size for _ in range(steps)]))
    return TableTraffic(
        lookups=float(draws), unique=unique, pulled=unique, asked=0.0, refreshed=0.0,
        pushed=unique, hit_rate=0.0, pull_requests=1.0, check_requests=0.0, push_requests=1.0,
    )  # fmt: skip


def simulate_table(
    sampler: Sampler,
    draws: int,
    cache: CachePlan,
    capacity: int,
    workers: int,
    *,
    seed: int = 0,
    measure_steps: int = 40,
    max_warm_steps: int = 400,
) -> TableTraffic:
    """One worker's steps through a cache of ``capacity`` rows (see the module docstring).

    Step ``s``: the serving pull of batch ``s`` (a conditional pull of all its ids with
    their copies' clocks: copies past the read bound come back), the prefetch of batch
    ``s + 1`` (a plain pull of its misses, admitted by evicting the least frequently /
    least recently used rows not in use, in chunks of capacity / 16), then the push of
    batch ``s``'s rows whose pending count passed the write bound (evicted rows with
    pending updates are pushed too). Statistics are taken after the
    cache is full (or ``max_warm_steps``) over ``measure_steps`` steps.
    """
    rng = np.random.default_rng(seed)
    tracked = min(sampler.rows, TRACKED)
    cap = min(capacity, tracked)
    in_cache = np.zeros(tracked, dtype=bool)
    key = np.zeros(tracked, dtype=np.int64)  # LFU: lookups since admitted; LRU: last step
    pending = np.zeros(tracked, dtype=np.int64)
    others = np.zeros(tracked, dtype=np.float64)  # others' pushes since the copy was read
    last = np.zeros(tracked, dtype=np.int64)
    slots = np.empty(0, dtype=np.int64)  # cached ranks
    rate_scale = (workers - 1) / (cache.write_bound + 1)
    lfu = cache.policy == "lfu"
    # TinyLFU: the key is how often an id was looked up so far (its sketch estimate, here
    # exact), and a miss is admitted only if that beats its victim's.
    tinylfu = cache.policy == "tinylfu"
    seen = np.zeros(tracked, dtype=np.int64) if tinylfu else None
    chunk = max(1, cap // 16)  # evict in chunks, as the cache does

    totals = np.zeros(8)  # unique, pulled, refreshed, pushed, hits, pulls, checks, pushes
    counted = 0
    full_at: int | None = None
    nxt = np.unique(sampler.draw(rng, draws))
    fetched_for_cur = 0  # misses the prefetch of the current batch fetched
    step = 0
    while True:
        cur = nxt
        nxt = np.unique(sampler.draw(rng, draws))
        measuring = full_at is not None and step >= full_at
        # serving pull of `cur` (prefetched last step): copies past the read bound
        refreshed = 0
        cc = cur[cur < tracked]
        h = cc[in_cache[cc]]
        if rate_scale > 0 and h.size:
            rate = rate_scale * sampler.touch_probability(draws, h)  # [H]
            others[h] += rng.poisson(rate * (step - last[h]))
            last[h] = step
            stale = others[h] > cache.read_bound
            refreshed = int(stale.sum())
            others[h[stale]] = 0
        # prefetch of `nxt`: a plain pull of its misses
        t = nxt[nxt < tracked]
        cold = nxt.size - t.size
        hit = in_cache[t]
        miss = t[~hit]
        free = cap - slots.size
        evict_pushed = 0
        fetched = miss.size + cold  # every miss is pulled, admitted or served through
        if seen is not None and miss.size > free:
            miss = _tinylfu_admits(miss, seen, slots, key, free, np.concatenate([cur, nxt]))
        if miss.size > free and slots.size:
            # TinyLFU evicts exactly the victims its admitted misses beat.
            need = min(miss.size - free if tinylfu else max(miss.size - free, chunk), slots.size)
            busy = np.isin(slots, nxt) | np.isin(slots, cur)
            cand = np.flatnonzero(~busy)
            need = min(need, cand.size)
            if need:
                # the lowest keys; ties go to the longest cached (stable order of slots)
                order = np.argsort(key[slots[cand]], kind="stable")[:need]
                out = slots[cand[order]]
                evict_pushed = int((pending[out] > 0).sum())
                in_cache[out] = False
                pending[out] = 0
                slots = np.delete(slots, cand[order])
        admit = miss[: max(0, cap - slots.size)]
        in_cache[admit] = True
        key[admit] = seen[admit] if seen is not None else 0 if lfu else step
        others[admit] = 0
        last[admit] = step + 1
        pending[admit] = 0
        slots = np.concatenate([slots, admit])
        # push of `cur`: one pending update per cached row; due rows go out
        c = cur[cur < tracked]
        c = c[in_cache[c]]
        pending[c] += 1
        due = c[pending[c] > cache.write_bound]
        pending[due] = 0
        if seen is not None:
            seen[cur[cur < tracked]] += 1
            key[c] = seen[c]
        elif lfu:
            key[c] += 1
        else:
            key[c] = step
        pushed = due.size + evict_pushed + (cur.size - c.size)  # uncached rows go at once
        pulled = fetched
        hits = cur.size - fetched_for_cur - refreshed  # the cache counts fetched rows as misses
        fetched_for_cur = pulled
        if measuring:
            totals += [
                cur.size, pulled, refreshed, pushed, hits,
                pulled > 0, cur.size > 0, pushed > 0,
            ]  # fmt: skip
            counted += 1
            if counted >= measure_steps:
                break
        if full_at is None and (slots.size >= cap or step >= max_warm_steps):
            full_at = step + 1
        step += 1
    m = [float(x) for x in totals / counted]  # unique, pulled, refreshed, pushed, hits, ...
    return TableTraffic(
        lookups=float(draws), unique=m[0], pulled=m[1], asked=m[0], refreshed=m[2],
        pushed=m[3], hit_rate=m[4] / max(m[0], 1e-12), pull_requests=m[5],
        check_requests=m[6], push_requests=m[7],
    )  # fmt: skip


def _tinylfu_admits(
    miss: np.ndarray,
    seen: np.ndarray,
    slots: np.ndarray,
    key: np.ndarray,
    free: int,
    busy: np.ndarray,
) -> np.ndarray:
    """The misses TinyLFU admits, most frequent first: the first ``free`` take free
    slots, each next one only if its count beats the next victim's (the least frequent
    cached rows not in ``busy`` use). The rest are served and pushed straight through."""
    order = miss[np.argsort(-seen[miss], kind="stable")]
    idle = slots[~np.isin(slots, busy)]
    victims = np.sort(key[idle], kind="stable")  # ascending
    contest = order[free : free + victims.size]
    better = seen[contest] > victims[: contest.size]  # both sorted: the winners are a prefix
    wins = contest.size if bool(better.all()) else int(np.argmin(better))
    return order[: free + wins]


class TrafficModel:
    """Samples each table's traffic for a plan; tables of the same shape and law, and
    repeated questions (a sweep over W), are sampled once."""

    def __init__(self, *, steps: int = 20, measure_steps: int = 40) -> None:
        self.steps, self.measure_steps = steps, measure_steps
        self._samplers: dict[tuple[object, ...], Sampler] = {}
        self._files: dict[str, dict[str, np.ndarray]] = {}
        self._memo: dict[tuple[object, ...], TableTraffic] = {}

    def sampler(self, law: IdLaw, table: TablePlan, names: list[str]) -> tuple[object, Sampler]:
        if law.ids_file is None:
            k: tuple[object, ...] = ("zipf", table.rows, float(law.zipf_a))
            if k not in self._samplers:
                self._samplers[k] = ZipfSampler(table.rows, law.zipf_a)
            return k, self._samplers[k]
        if law.ids_file not in self._files:
            self._files[law.ids_file] = load_id_file(law.ids_file, names)
        k = ("file", law.ids_file, table.name)
        if k not in self._samplers:
            self._samplers[k] = FileSampler(
                self._files[law.ids_file][table.name], f"ids file {law.ids_file!r}, {table.name}"
            )
        return k, self._samplers[k]

    def traffic(self, plan: Plan) -> dict[str, TableTraffic]:
        model, cluster, cache = plan.model, plan.cluster, plan.cache
        names = [t.name for t in model.tables]
        out = {}
        for t in model.tables:
            key, sampler = self.sampler(model.law, t, names)
            draws = t.draws(cluster.batch_per_worker)
            cached = cache.on and t.placement == "hybrid"
            capacity = cache.capacity(t.rows) if cached else 0
            memo: tuple[object, ...] = (key, draws, model.law.seed)
            if cached:
                memo += (capacity, cache.read_bound, cache.write_bound, cache.policy,
                         cluster.workers)  # fmt: skip
            if memo not in self._memo:
                if cached:
                    self._memo[memo] = simulate_table(
                        sampler, draws, cache, capacity, cluster.workers,
                        seed=model.law.seed, measure_steps=self.measure_steps,
                    )  # fmt: skip
                else:
                    self._memo[memo] = uncached_traffic(sampler, draws, self.steps, model.law.seed)
            out[t.name] = self._memo[memo]
        return out
