"""An EmbeddingCollection on a device: every placement and every optimizer equals an
independent reference, and batches on another device are moved at the boundary.

The reference (float64, on the host, sharing no code with the collection): one dense
copy per table, each feature pooled by ``torch.nn.functional.embedding_bag`` (or
``embedding``) with autograd giving the dense gradient of a linear loss, and the
optimizer replayed on the touched rows by ``tests/support/ps_reference.py`` (``torch.optim``
where torch has the rule, the published formulas otherwise). The loss is linear in
the outputs, so each step's row gradients do not depend on the rows and the replay
from the initial rows gives the reference after every step.

Tolerances (``tests/support/tolerance.py``): the same steps in float32 (autograd in float32, the ps
optimizer's ``apply`` in float32) measure how far float32 rounding moves this computation
from the float64 reference; the collection, another float32 run, may be a few times that
far (:func:`replay_tol`), and never less than the roundings of the last step alone.

The CPU variant runs everywhere; the ``cuda`` one (``gpu`` marker) on a GPU machine.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import ps
from cache import CacheConfig, CachedStore
from embedding import EmbeddingCollection, KeyedJaggedIds, TableConfig
from embedding_reference import UPDATE_ROUNDINGS
from ps_reference import reference
from tolerance import assert_close, assert_same, replay_tol, sum_tol

pytestmark = [pytest.mark.timeout(120), pytest.mark.numerics]

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
PLACEMENTS = ["local", "hybrid", "hybrid-cached", "hybrid-device-cache", "sharded"]
OPTIMIZERS = {
    "sgd-momentum": ps.SGD(lr=0.1, momentum=0.9),
    "rowwise_adagrad": ps.RowWiseAdagrad(lr=0.1),
    "adagrad": ps.Adagrad(lr=0.1),
    "adam": ps.Adam(lr=0.05),
    "ftrl": ps.FTRL(alpha=0.2, l1=0.001),
}
B = 4
STEPS = 2
REPLAY_WHY = (
    "4x a float32 replay's distance to the float64 reference; never below the roundings "
    "of the last step (a pooling, or a row's gradient sum and one update)"
)


def _tables(opt: ps.Optimizer, placement: str) -> list[TableConfig]:
    """Two tables of one dim (one fused group when local), one of another dim."""
    where = "hybrid" if placement.startswith("hybrid") else placement
    tables = [
        TableConfig(name="a", num_rows=11, dim=4, feature_names=["a1", "a2"], pooling="sum"),
        TableConfig(name="b", num_rows=7, dim=4, feature_names=["b"], pooling="mean"),
        TableConfig(name="c", num_rows=5, dim=3, feature_names=["c"], pooling="none"),
    ]
    return [dataclasses.replace(t, optimizer=opt, placement=where) for t in tables]  # type: ignore[arg-type]


def _collection(
    tables: list[TableConfig], placement: str, device: str | torch.device
) -> EmbeddingCollection:
    store: ps.Store = ps.InProcessStore()
    bounds0 = CacheConfig(capacity_rows=4, read_bound=0, write_bound=0)
    if placement == "hybrid-cached":  # synchronous bounds: the cache changes no value
        store = CachedStore(store, bounds0)
    if placement == "hybrid-device-cache":  # the cached rows in the device's memory
        store = CachedStore(store, bounds0, device=device)
    return EmbeddingCollection(tables, store=store, device=device)


def _batch(gen: torch.Generator, tables: list[TableConfig]) -> KeyedJaggedIds:
    lists: dict[str, list[list[int]]] = {}
    for t in tables:
        assert t.num_rows is not None
        for f in t.feature_names:
            sizes = [2] * B if t.pooling == "none" else torch.randint(0, 4, (B,), generator=gen)
            lists[f] = [
                torch.randint(0, t.num_rows, (int(n),), generator=gen).tolist() for n in sizes
            ]
    return KeyedJaggedIds.from_lists(lists)


def _targets(gen: torch.Generator, tables: list[TableConfig]) -> dict[str, torch.Tensor]:
    out = {}
    for t in tables:
        for f in t.feature_names:
            shape = (B, 2, t.dim) if t.pooling == "none" else (B, t.dim)
            out[f] = torch.randn(shape, generator=gen, dtype=torch.float64)
    return out


class DenseReference:
    """Dense float64 tables; forward pools like ``EmbeddingBag``; ``step`` records the
    touched rows' gradients and replays every push from the initial rows.

    Alongside, the same steps in float32 (``rows32``, ``state32``: autograd in float32,
    then the ps optimizer's own ``apply``), whose distance to the float64 reference is
    the rounding error the tolerances are built from; ``occ`` is the most occurrences of
    one id of a table in one batch."""

    def __init__(self, tables: list[TableConfig]) -> None:
        self.tables = {t.name: t for t in tables}
        self.w0 = {
            t.name: t.to_spec().initial_rows(torch.arange(int(t.num_rows or 0))) for t in tables
        }
        self.rows = {n: w.double() for n, w in self.w0.items()}
        self.state: dict[str, torch.Tensor] = {}
        self.clocks = {n: torch.zeros(w.shape[0], dtype=torch.int64) for n, w in self.w0.items()}
        self.pushes: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {n: [] for n in self.w0}
        self.rows32 = {n: w.float().clone() for n, w in self.w0.items()}
        self.state32 = {
            t.name: t.optimizer.initial_state(t.dim)  # type: ignore[union-attr]
            .expand(int(t.num_rows or 0), -1)
            .clone()
            for t in tables
        }
        self.occ = {n: 0 for n in self.w0}

    def forward(
        self, kjt: KeyedJaggedIds, rows: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        out = {}
        for t in self.tables.values():
            for f in t.feature_names:
                j = kjt[f]
                if t.pooling == "none":
                    out[f] = F.embedding(j.ids, rows[t.name]).view(B, -1, t.dim)
                else:
                    offsets = j.offsets()[:-1]
                    out[f] = F.embedding_bag(j.ids, rows[t.name], offsets, mode=t.pooling)
        return out

    def step(self, kjt: KeyedJaggedIds, targets: dict[str, torch.Tensor]) -> None:
        leaves = {n: r.clone().requires_grad_() for n, r in self.rows.items()}
        out = self.forward(kjt, leaves)
        sum((out[f] * targets[f]).sum() for f in out).backward()  # type: ignore[union-attr]
        leaves32 = {n: r.clone().requires_grad_() for n, r in self.rows32.items()}
        out32 = self.forward(kjt, leaves32)
        loss32 = sum((out32[f] * targets[f].float()).sum() for f in out32)
        loss32.backward()  # type: ignore[union-attr]
        for name, t in self.tables.items():
            ids = torch.cat([kjt[f].ids for f in t.feature_names])
            touched, counts = torch.unique(ids, return_counts=True)
            if touched.numel() == 0:
                continue
            self.occ[name] = max(self.occ[name], int(counts.max()))
            grad, grad32 = leaves[name].grad, leaves32[name].grad
            assert grad is not None and grad32 is not None
            self.pushes[name].append((touched, grad[touched].float()))
            self.clocks[name][touched] += 1
            self.rows[name], self.state[name] = reference(
                t.optimizer, self.w0[name], self.pushes[name]
            )
            rows32, state32 = self.rows32[name][touched], self.state32[name][touched]
            t.optimizer.apply(rows32, state32, grad32[touched])  # type: ignore[union-attr]
            self.rows32[name][touched], self.state32[name][touched] = rows32, state32

    def output_tol(self, kjt: KeyedJaggedIds, f: str) -> float:
        """Output ``f``: the float32 replay's measured error, never below two fp32 poolings
        of the same rows (up to ``n`` additions, a mean's ``1 / len`` and its product: ``n + 2``
        roundings of the largest bag's sum of ``|row|``, in float64)."""
        want32, want = self.forward(kjt, self.rows32)[f], self.forward(kjt, self.rows)[f]
        magnitude = self.forward(kjt, {n: r.abs() for n, r in self.rows.items()})[f]
        lengths = kjt[f].offsets()[1:] - kjt[f].offsets()[:-1]
        longest = int(lengths.max()) if lengths.numel() else 0
        floor = sum_tol(torch.float32, longest + 2, float(magnitude.max()))
        return max(replay_tol(want32, want), floor)

    def rows_tol(self, name: str) -> float:
        """Table ``name``'s rows: a gradient of up to ``occ`` terms and one update."""
        terms = self.occ[name] + UPDATE_ROUNDINGS
        return replay_tol(self.rows32[name], self.rows[name], floor_terms=terms)

    def assert_state_close(self, name: str, state: torch.Tensor) -> None:
        """Table ``name``'s state, in groups of ``dim`` columns (moments, accumulators, step
        counts: each on its own scale): an accumulator of squares doubles the gradient's
        relative error, row-wise Adagrad adds a mean over ``dim``."""
        dim = self.tables[name].dim
        terms = 2 * self.occ[name] + dim + UPDATE_ROUNDINGS
        parts = (state.double(), self.state[name], self.state32[name])
        for k, (got, want, want32) in enumerate(
            zip(*(p.split(dim, 1) for p in parts), strict=True)
        ):
            assert_close(
                got, want, atol=replay_tol(want32, want, floor_terms=terms),
                what=f"table {name} state columns {k * dim}..", why=REPLAY_WHY,
            )  # fmt: skip


def _table_now(ec: EmbeddingCollection, t: TableConfig) -> tuple[torch.Tensor, ...]:
    """``(rows, state, clocks)`` of table ``t``, whole, on the host."""
    if t.placement == "sharded":
        assert ec.sharded is not None
        sh = ec.sharded
        return tuple(
            x.cpu()
            for x in (sh.full_table(t.name), sh.full_state(t.name), sh.full_clocks(t.name))  # type: ignore[operator]
        )
    if isinstance(ec.store, CachedStore):
        ec.store.flush()
    ids = torch.arange(int(t.num_rows or 0))
    return ec.rows(t.name, ids).cpu(), ec.state(t.name, ids).cpu(), ec.clocks(t.name, ids).cpu()


def _train_and_compare(
    ec: EmbeddingCollection, tables: list[TableConfig], device: str, seed: int = 0
) -> None:
    gen = torch.Generator().manual_seed(seed)
    ref = DenseReference(tables)
    for _ in range(STEPS):
        kjt, targets = _batch(gen, tables), _targets(gen, tables)
        want = ref.forward(kjt, ref.rows)
        out = ec(kjt)  # a host batch: the collection moves it to its device
        assert list(out) == kjt.keys
        for f, o in out.items():
            assert o.device.type == torch.device(device).type, f
            got = o.detach().double().cpu()
            assert_close(
                got, want[f], atol=ref.output_tol(kjt, f), what=f"output {f}", why=REPLAY_WHY
            )
        loss = sum((o * targets[f].to(o.device, torch.float32)).sum() for f, o in out.items())
        loss.backward()  # type: ignore[union-attr]
        ref.step(kjt, targets)
    for t in tables:
        rows, state, clocks = _table_now(ec, t)
        assert_close(
            rows.double(), ref.rows[t.name], atol=ref.rows_tol(t.name), what=f"table {t.name} rows",
            why=REPLAY_WHY,
        )  # fmt: skip
        ref.assert_state_close(t.name, state)
        assert torch.equal(clocks, ref.clocks[t.name]), t.name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_every_placement_and_optimizer_equals_the_reference(
    device: str, placement: str, opt_name: str
) -> None:
    tables = _tables(OPTIMIZERS[opt_name], placement)
    ec = _collection(tables, placement, device)
    assert ec.device.type == device
    _train_and_compare(ec, tables, device)


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_placements_in_one_collection_on_the_device(device: str) -> None:
    """Local, hybrid and sharded tables side by side, weighted ids: one batch, one
    backward, every table equal to the reference; a batch already on the device and
    one on the host give the same outputs."""
    opt = ps.RowWiseAdagrad(lr=0.2)
    tables = [
        TableConfig(name="a", num_rows=11, dim=4, feature_names=["a1", "a2"], optimizer=opt),
        TableConfig(
            name="b", num_rows=7, dim=4, feature_names=["b"], optimizer=opt, placement="hybrid"
        ),
        TableConfig(
            name="c", num_rows=5, dim=4, feature_names=["c"], optimizer=opt, placement="sharded"
        ),
    ]
    ec = EmbeddingCollection(tables, device=device)
    _train_and_compare(ec, tables, device, seed=3)
    kjt = KeyedJaggedIds.from_lists(
        {"a1": [[1, 2], [3]], "a2": [[], [4]], "b": [[0], [6, 6]], "c": [[4], []]},
        weights={"a1": [[0.5, 2.0], [1.0]], "a2": [[], [3.0]], "b": [[1.0], [0.5, 0.5]],
                 "c": [[2.0], []]},
    )  # fmt: skip
    with torch.no_grad():
        from_host = ec(kjt)
        on_device = ec(kjt.to(device))
    for f in kjt.keys:
        assert from_host[f].device.type == device
        assert_same(
            from_host[f], on_device[f], what=f"output {f}, host vs device batch",
            why="the host batch is moved to the device first; then both run the same lookup "
            "on the same rows",
        )  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
def test_boundary_moves_each_tensor_and_rejects_bad_input(device: str) -> None:
    """A batch whose tensors sit on different devices is moved tensor by tensor; bad
    ids and weights raise naming the feature and table, before any row changes."""
    t = TableConfig(name="t", num_rows=6, dim=2, feature_names=["x"], optimizer=ps.SGD(lr=1.0))
    ec = EmbeddingCollection([t], device=device)
    ids = torch.tensor([1, 2, 5])
    mixed = KeyedJaggedIds(["x"], ids, torch.tensor([2, 1]).to(device))
    out = ec(mixed)["x"]
    assert out.device.type == device and out.shape == (2, 2)
    before = ec.rows("t", torch.arange(6)).clone()
    with pytest.raises(ValueError, match=r"feature 'x' has id 6, out of range for table 't'"):
        ec(KeyedJaggedIds(["x"], torch.tensor([6]), torch.tensor([1, 0])))
    half = KeyedJaggedIds(["x"], ids, torch.tensor([2, 1]), torch.ones(3, dtype=torch.float16))
    ec(half)["x"].sum().backward()  # float16 weights are taken (as float32)
    with pytest.raises(TypeError, match="ids must be an int64 tensor, got torch.int32"):
        KeyedJaggedIds(["x"], ids.int(), torch.tensor([2, 1]))
    with pytest.raises(TypeError, match="expected a KeyedJaggedIds, got Tensor"):
        ec(ids)  # type: ignore[arg-type]
    assert not torch.equal(ec.rows("t", torch.arange(6)), before)  # only the good batch trained


@pytest.mark.parametrize("device", DEVICES)
def test_prefetch_takes_host_or_device_batches(device: str) -> None:
    t = TableConfig(name="h", num_rows=30, dim=3, feature_names=["x"], placement="hybrid")
    cached = CachedStore(ps.InProcessStore(), CacheConfig(capacity_rows=10, prefetch="on"))
    ec = EmbeddingCollection([t], store=cached, device=device)
    first = KeyedJaggedIds.from_lists({"x": [[1, 2], [3]]})
    nxt = KeyedJaggedIds.from_lists({"x": [[4, 2], [6]]})
    ec.prefetch(nxt.to(device))  # the store gets host ids either way
    ec(first)["x"].sum().backward()
    ec(nxt)["x"].sum().backward()
    assert cached.cache_stats()["h"]["prefetched"] == 2  # 4 and 6 rode on the first pull


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where CUDA is missing")
def test_cuda_without_cuda_is_a_clear_error() -> None:
    t = TableConfig(name="t", num_rows=3, dim=2, feature_names=["x"])
    with pytest.raises(ValueError, match="device 'cuda:1' asked for, but torch sees no CUDA"):
        EmbeddingCollection([t], device="cuda:1")
