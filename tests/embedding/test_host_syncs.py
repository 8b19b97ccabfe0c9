"""Device <-> host crossings per training step, counted for each placement.

Product code crosses between a worker's device and the host only through
:mod:`comm.boundary` (``read``/``to_host``: device -> host, at most one host sync each on
a GPU; ``to_device``/``move``: host -> device, one copy queued without waiting). The
calls are made at the same places whatever the device, so counting them on the CPU
pins how many times a GPU step may cross: the numbers below are the ones quoted in
docs/gpu.md ("Host synchronisations per step"), and they must not grow with the
number of tables. The ``gpu`` test counts torch's own sync warnings on a GPU, where
reads hidden in ops such as ``torch.unique`` add to them.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import cache
import ps
from comm import LocalGroup, boundary
from embedding import EmbeddingCollection, KeyedJaggedIds, TableConfig
from embedding.ngram import NGramConfig

pytestmark = pytest.mark.timeout(120)

BATCH = 16
DIM = 8
STEPS = 4  # the first one makes the caches and the per-layout constants; then counted
SEQ = 6  # tokens per window of the n-gram placement


@dataclass(frozen=True)
class Case:
    """A placement and the crossings of each of its steps: device -> host reads, host ->
    device copies."""

    placement: str
    d2h: int
    h2d: int


# Per step, one rank, as measured after the fixes (docs/gpu.md quotes them):
#   local:        d2h the id range check; h2d the batch
#   sharded:      d2h the range check, the [W, T] counts, the exchanged counts and flags
#                 (answered on the device by nccl); h2d the batch
#   hybrid:       d2h the range check, the unique ids for the store, the row gradients
#                 for the push; h2d the batch, the pulled rows
#   hybrid behind a host cache: the same (the cache works on host tensors)
#   hybrid behind a device cache (group_tables, as in the jobs): d2h the range check,
#                 the unique ids, the finite check of every table's gradients, the rows
#                 due to the store; h2d the batch, the store's rows and their optimizer
#                 state (the copies' local step), the slot indices of install, serve and
#                 update (one cache per dim: they do not grow with the tables)
#   n-gram (token + 4 n-gram tables, unpooled, two dims): d2h the range check, the
#                 sequence lengths, the unique ids, the row gradients; h2d the batch, rows
CASES = [
    Case("local", d2h=1, h2d=1),
    Case("sharded", d2h=3, h2d=1),
    Case("hybrid", d2h=3, h2d=2),
    Case("hybrid_host_cache", d2h=3, h2d=2),
    Case("hybrid_device_cache", d2h=4, h2d=6),
    Case("ngram", d2h=4, h2d=2),
]


def dlrm_tables(n: int, placement: str) -> list[TableConfig]:
    """``n`` pooled tables of one dim and different sizes (the range check then reads
    every feature's bounds, not one for the batch), one feature each."""
    return [
        TableConfig(
            name=f"t{i}",
            num_rows=5_000 + 97 * i,
            dim=DIM,
            feature_names=[f"f{i}"],
            placement=placement,
            optimizer=ps.RowWiseAdagrad(lr=0.05),
        )  # fmt: skip
        for i in range(n)
    ]


def dlrm_batch(g: torch.Generator, n: int, pin: bool = False) -> KeyedJaggedIds:
    """``BATCH`` samples of 0..3 ids per feature (some bags empty), on the host."""
    lengths = torch.randint(0, 4, (n * BATCH,), generator=g)
    per_key = lengths.view(n, BATCH).sum(dim=1).tolist()
    ids = torch.cat([torch.randint(0, 5_000, (k,), generator=g) for k in per_key])
    kjt = KeyedJaggedIds([f"f{i}" for i in range(n)], ids, lengths)
    return kjt.pin_memory() if pin else kjt


def ngram_setup(device: str) -> tuple[EmbeddingCollection, NGramConfig]:
    """A token table and the n-gram tables of n = 2, 3 in two splits (width DIM / 2: two
    dim groups), all hybrid and unpooled, as the LM job's input tables."""
    ngrams = NGramConfig(max_n=3, rows=4_000, dim=DIM, splits=2, optimizer=ps.Adam(lr=0.01))
    token = TableConfig(
        name="tokens", num_rows=500, dim=DIM, feature_names=["tokens"], pooling="none",
        placement="hybrid", optimizer=ps.Adam(lr=0.01),
    )  # fmt: skip
    return EmbeddingCollection([token, *ngrams.tables()], device=device), ngrams


def ngram_batch(g: torch.Generator, ngrams: NGramConfig, device: str) -> KeyedJaggedIds:
    """The LM job's batch: token ids and their n-gram ids ``[B, T]`` made where the tokens
    are, lengths on the host (``hybridrec.lm.model.input_batch``)."""
    tokens = torch.randint(0, 500, (BATCH, SEQ), generator=g).to(device)
    features = {"tokens": tokens} | ngrams.ids(tokens)
    lengths = torch.full((BATCH * len(features),), SEQ, dtype=torch.int64)
    return KeyedJaggedIds(
        list(features), torch.cat([v.reshape(-1) for v in features.values()]), lengths
    )


def collection(placement: str, n: int, device: str) -> EmbeddingCollection:
    if placement in ("local", "sharded"):
        return EmbeddingCollection(dlrm_tables(n, placement), group=LocalGroup(), device=device)
    store: ps.Store = ps.InProcessStore()
    if placement != "hybrid":
        cfg = cache.CacheConfig(capacity_fraction=0.5, read_bound=8, group_tables=True)
        on = device if placement == "hybrid_device_cache" else None
        store = cache.CachedStore(store, cfg, device=on, owns_store=True)
    return EmbeddingCollection(dlrm_tables(n, "hybrid"), store=store, device=device)


def batches(
    placement: str, n: int, device: str
) -> tuple[EmbeddingCollection, list[KeyedJaggedIds]]:
    """The collection and ``STEPS + 1`` batches (the last one only announced)."""
    g = torch.Generator().manual_seed(7)
    if placement == "ngram":
        emb, ngrams = ngram_setup(device)
        return emb, [ngram_batch(g, ngrams, device) for _ in range(STEPS + 1)]
    pin = device != "cpu"
    return collection(placement, n, device), [dlrm_batch(g, n, pin) for _ in range(STEPS + 1)]


def train_steps(
    emb: EmbeddingCollection, data: list[KeyedJaggedIds], mark: Callable[[], None]
) -> None:
    """What a job's step does with the collection: announce the next batch (a cache
    pulls it along), forward, a loss over every output, backward (which updates the
    rows); ``mark()`` after each step."""
    for kjt, nxt in zip(data[:-1], data[1:], strict=True):
        emb.prefetch(nxt)
        out = emb(kjt)
        loss = sum((v.float() ** 2).mean() for v in out.values())
        assert isinstance(loss, torch.Tensor)
        loss.backward()
        mark()


class Crossings:
    """The calls of :mod:`comm.boundary`'s functions, per step."""

    D2H = ("read", "to_host")
    H2D = ("to_device", "move")

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now: Counter[str] = Counter()
        self.steps: list[Counter[str]] = []
        for name in (*self.D2H, *self.H2D):
            monkeypatch.setattr(boundary, name, self._counted(name, getattr(boundary, name)))

    def _counted(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        kind = "d2h" if name in self.D2H else "h2d"

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.now[kind] += 1
            return fn(*args, **kwargs)

        return counted

    def mark(self) -> None:
        self.steps.append(self.now)
        self.now = Counter()

    def per_step(self) -> list[tuple[int, int]]:
        """``(d2h, h2d)`` of each step after the first."""
        return [(c["d2h"], c["h2d"]) for c in self.steps[1:]]


@pytest.mark.parametrize(
    ("case", "tables"),
    [(c, n) for c in CASES for n in ((26,) if c.placement == "ngram" else (13, 26))],
    ids=lambda x: x.placement if isinstance(x, Case) else f"{x}tables",
)
def test_crossings_per_step(case: Case, tables: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each step of each placement crosses the counted number of times, the same for 13
    and 26 tables (the n-gram case has its own five tables)."""
    emb, data = batches(case.placement, tables, "cpu")
    seen = Crossings(monkeypatch)
    try:
        train_steps(emb, data, seen.mark)
    finally:
        emb.store.close()
    assert seen.per_step() == [(case.d2h, case.h2d)] * (STEPS - 1), seen.steps


def test_a_second_dim_group_adds_no_crossing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hybrid tables of two dims (two dedup groups): still one read of the unique ids and
    one of the gradients, one copy of the rows."""
    tables = dlrm_tables(26, "hybrid")
    tables = [
        t
        if i % 2
        else TableConfig(
            name=t.name,
            num_rows=t.num_rows,
            dim=2 * DIM,
            feature_names=t.feature_names,
            placement="hybrid",
            optimizer=t.optimizer,
        )  # fmt: skip
        for i, t in enumerate(tables)
    ]
    emb = EmbeddingCollection(tables, device="cpu")
    g = torch.Generator().manual_seed(3)
    seen = Crossings(monkeypatch)
    train_steps(emb, [dlrm_batch(g, 26) for _ in range(STEPS + 1)], seen.mark)
    assert seen.per_step() == [(3, 2)] * (STEPS - 1), seen.steps


# ---------------------------------------------------------------- on a GPU


def sync_warnings(emb: EmbeddingCollection, data: list[KeyedJaggedIds]) -> list[int]:
    """Synchronising CUDA calls per step after the first, as torch reports them with
    ``set_sync_debug_mode("warn")``."""
    per_step: list[int] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            seen = 0

            def mark() -> None:
                nonlocal seen
                now = sum("synchronizing CUDA operation" in str(w.message) for w in caught)
                per_step.append(now - seen)
                seen = now

            train_steps(emb, data, mark)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return per_step[1:]


def _gpu_counts(placement: str, tables: int) -> list[int]:
    emb, data = batches(placement, tables, "cuda")
    try:
        return sync_warnings(emb, data)
    finally:
        emb.store.close()


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES, ids=[c.placement for c in CASES])
def test_gpu_syncs_per_step(case: Case) -> None:
    """On a GPU every deliberate read is a sync at most, and for every placement but the
    sharded one the syncs of a step do not grow with the tables; sharded tables add at
    most two per table (``torch.unique`` of its ids forward, of its rows backward)."""
    few, many = _gpu_counts(case.placement, 13), _gpu_counts(case.placement, 26)
    print(f"{case.placement}: syncs per step, 13 tables {few}, 26 tables {many}")
    assert len(set(few)) == 1 and len(set(many)) == 1, (few, many)
    # Every deliberate read syncs, but the sharded one of the exchanged counts: one
    # rank's exchange answers on the host.
    assert many[0] >= case.d2h - (case.placement == "sharded"), many
    if case.placement == "sharded":
        assert 0 <= many[0] - few[0] <= 2 * 13, (few, many)
    else:
        assert many == few, (few, many)
