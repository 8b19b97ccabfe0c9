"""EmbeddingCollection + the in-process store vs plain torch.nn.EmbeddingBag.

The reference keeps one dense ``nn.EmbeddingBag`` per table (initial weights
copied from the store), pools each feature separately (no dedup, no shared
lookup), takes the dense ``.grad`` from autograd and applies the optimizer by
hand (row-wise Adagrad on the rows the batch touched) or with
``torch.optim.SGD``. After every step the store's rows must match.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import ps
from embedding import EmbeddingCollection, KeyedJaggedIds, RowWiseAdagrad, TableConfig

pytestmark = pytest.mark.timeout(120)

B = 6  # samples per batch
STEPS = 6


def _random_batch(gen: torch.Generator, features: dict[str, int], weighted: bool) -> KeyedJaggedIds:
    """Jagged ids per feature: 0-4 ids per sample (empty bags), drawn from a small
    range so ids repeat within and across samples and features."""
    lists: dict[str, list[list[int]]] = {}
    for feat, num_rows in features.items():
        hot = min(num_rows, 7)  # ids mostly from a few hot rows, some from anywhere
        samples = []
        for _ in range(B):
            n = int(torch.randint(0, 5, (1,), generator=gen))
            ids = torch.where(
                torch.rand(n, generator=gen) < 0.7,
                torch.randint(0, hot, (n,), generator=gen),
                torch.randint(0, num_rows, (n,), generator=gen),
            )
            samples.append(ids.tolist())
        lists[feat] = samples
    if not weighted:
        return KeyedJaggedIds.from_lists(lists)
    w = {
        f: [[0.5 + float(torch.rand(1, generator=gen)) for _ in s] for s in v]
        for f, v in lists.items()
    }
    return KeyedJaggedIds.from_lists(lists, weights=w)


class _Reference:
    """Dense EmbeddingBags per table and a hand-written optimizer."""

    def __init__(self, tables: list[TableConfig], store: ps.Store) -> None:
        self.tables = {t.name: t for t in tables}
        self.table_of = {f: t.name for t in tables for f in t.feature_names}
        self.bags = {}
        self.acc = {}
        for t in tables:
            bag = nn.EmbeddingBag(t.num_rows, t.dim, mode=t.pooling)
            with torch.no_grad():
                bag.weight.copy_(store.pull(t.name, torch.arange(t.num_rows)).rows)
            self.bags[t.name] = bag
            opt = t.optimizer
            if isinstance(opt, RowWiseAdagrad):
                self.acc[t.name] = torch.full((t.num_rows,), opt.initial_accumulator)
        self.sgd = {
            t.name: torch.optim.SGD(self.bags[t.name].parameters(), lr=t.optimizer.lr)
            for t in tables
            if isinstance(t.optimizer, ps.SGD)
        }

    def forward(self, kjt: KeyedJaggedIds) -> dict[str, torch.Tensor]:
        out = {}
        for feat in kjt.keys:
            j = kjt[feat]
            bag = self.bags[self.table_of[feat]]
            # offsets of the bags, [B]; per-id weights only in sum mode
            out[feat] = bag(j.ids, j.offsets()[:-1], per_sample_weights=j.weights)
        return out

    def step(self, kjt: KeyedJaggedIds) -> None:
        for name, t in self.tables.items():
            bag = self.bags[name]
            if isinstance(t.optimizer, ps.SGD):
                self.sgd[name].step()
                self.sgd[name].zero_grad()
                continue
            assert isinstance(t.optimizer, RowWiseAdagrad)
            feats = [f for f in t.feature_names if f in kjt]
            if not feats:
                continue
            touched = torch.unique(torch.cat([kjt[f].ids for f in feats]))
            grad = bag.weight.grad
            assert grad is not None
            g = grad[touched]  # [U, D]
            acc = self.acc[name]
            acc[touched] += (g * g).mean(dim=1)
            lr, eps = t.optimizer.lr, t.optimizer.eps
            with torch.no_grad():
                bag.weight[touched] -= lr * g / (acc[touched].sqrt() + eps).unsqueeze(1)
            bag.weight.grad = None


def _loss(pooled: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]) -> torch.Tensor:
    return sum((pooled[f] * targets[f]).sum() for f in pooled)  # type: ignore[return-value]


def _train_and_compare(tables: list[TableConfig], weighted: bool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    ec = EmbeddingCollection(tables)
    ref = _Reference(tables, ec.store)
    features = {f: t.num_rows for t in tables for f in t.feature_names}
    targets = {f: torch.randn(B, t.dim, generator=gen) for t in tables for f in t.feature_names}
    for step in range(STEPS):
        kjt = _random_batch(gen, features, weighted)
        got = ec(kjt)
        want = ref.forward(kjt)
        assert list(got) == kjt.keys
        for f in kjt.keys:
            torch.testing.assert_close(got[f], want[f], rtol=0, atol=1e-6)
        _loss(got, targets).backward()
        _loss(want, targets).backward()
        ref.step(kjt)
        for t in tables:
            rows = ec.store.pull(t.name, torch.arange(t.num_rows)).rows
            err = float((rows - ref.bags[t.name].weight.detach()).abs().max())
            assert err <= 1e-6, f"table {t.name} after step {step}: rows differ by {err:.3g}"
            if t.name in ref.acc:
                state = ec.store.state(t.name, torch.arange(t.num_rows))[:, 0]
                torch.testing.assert_close(state, ref.acc[t.name], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rowwise_adagrad_sum_and_mean_shared_table(seed: int) -> None:
    tables = [
        # two features share one table
        TableConfig(
            name="items", num_rows=30, dim=8, feature_names=["clicked", "bought"], pooling="sum",
            optimizer=RowWiseAdagrad(lr=0.1),
        ),
        TableConfig(
            name="users", num_rows=12, dim=4, feature_names=["user"], pooling="mean",
            optimizer=RowWiseAdagrad(lr=0.05, eps=1e-6, initial_accumulator=0.1),
        ),
    ]  # fmt: skip
    _train_and_compare(tables, weighted=False, seed=seed)


@pytest.mark.parametrize("seed", [0, 1])
def test_rowwise_adagrad_weighted_sum(seed: int) -> None:
    tables = [
        TableConfig(
            name="items", num_rows=25, dim=6, feature_names=["a", "b"], pooling="sum",
            optimizer=RowWiseAdagrad(lr=0.2),
        ),
        TableConfig(
            name="cats", num_rows=9, dim=3, feature_names=["c"], pooling="sum",
            optimizer=RowWiseAdagrad(lr=0.1),
        ),
    ]  # fmt: skip
    _train_and_compare(tables, weighted=True, seed=seed)


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_sgd_matches_torch_optim_sgd(pooling: str) -> None:
    tables = [
        TableConfig(
            name="t", num_rows=20, dim=5, feature_names=["x", "y"], pooling=pooling,  # type: ignore[arg-type]
            optimizer=ps.SGD(lr=0.3),
        ),
    ]  # fmt: skip
    _train_and_compare(tables, weighted=False, seed=5)


def test_eval_and_no_grad_never_push() -> None:
    cfg = TableConfig(name="t", num_rows=10, dim=3, feature_names=["x"], optimizer=ps.SGD(lr=1.0))
    ec = EmbeddingCollection([cfg])
    kjt = KeyedJaggedIds.from_lists({"x": [[1, 2], [2]]})
    before = ec.store.pull("t", torch.arange(10))
    with torch.no_grad():
        out = ec(kjt)["x"]
    assert not out.requires_grad
    ec.eval()
    out = ec(kjt)["x"]
    assert not out.requires_grad
    after = ec.store.pull("t", torch.arange(10))
    assert torch.equal(before.rows, after.rows) and torch.equal(before.clocks, after.clocks)
    ec.train()
    ec(kjt)["x"].sum().backward()
    assert ec.store.clocks("t", torch.arange(10)).tolist() == [0, 1, 1, 0, 0, 0, 0, 0, 0, 0]


def test_pooled_values_by_hand() -> None:
    cfg = TableConfig(name="t", num_rows=5, dim=2, feature_names=["x", "y"], pooling="mean")
    ec = EmbeddingCollection([cfg])
    w = ec.store.pull("t", torch.arange(5)).rows
    out = ec(KeyedJaggedIds.from_lists({"y": [[4], []], "x": [[1, 1, 3], [0]]}))
    assert list(out) == ["y", "x"]
    torch.testing.assert_close(out["y"], torch.stack([w[4], torch.zeros(2)]))
    torch.testing.assert_close(out["x"], torch.stack([(2 * w[1] + w[3]) / 3, w[0]]))


def test_bad_inputs() -> None:
    cfg = TableConfig(name="t", num_rows=5, dim=2, feature_names=["x", "y"], pooling="mean")
    ec = EmbeddingCollection([cfg])
    before = ec.store.pull("t", torch.arange(5))
    with pytest.raises(
        ValueError, match=r"feature 'z' is not in any table; known features: \['x', 'y'\]"
    ):
        ec(KeyedJaggedIds.from_lists({"z": [[1]]}))
    with pytest.raises(
        ValueError,
        match=r"feature 'y' has id 5, out of range for table 't' with 5 rows "
        r"\(valid ids \[0, 5\)\)",
    ):
        ec(KeyedJaggedIds.from_lists({"x": [[1], [4]], "y": [[0], [5]]}))
    with pytest.raises(ValueError, match="feature 'x' has id -1"):
        ec(KeyedJaggedIds.from_lists({"x": [[-1]]}))
    with pytest.raises(ValueError, match="weights need pooling='sum'"):
        ec(KeyedJaggedIds.from_lists({"x": [[1]]}, weights={"x": [[2.0]]}))
    with pytest.raises(TypeError, match="expected a KeyedJaggedIds"):
        ec({"x": torch.tensor([1])})  # type: ignore[arg-type]
    after = ec.store.pull("t", torch.arange(5))
    assert torch.equal(before.rows, after.rows) and torch.equal(before.clocks, after.clocks)


def test_config_validation_and_feature_conflicts() -> None:
    with pytest.raises(ValueError, match=r"table 't': dim must be an int > 0, got 0"):
        TableConfig(name="t", num_rows=5, dim=0, feature_names=["x"])
    with pytest.raises(ValueError, match=r"table 't': num_rows must be an int > 0, got -1"):
        TableConfig(name="t", num_rows=-1, dim=2, feature_names=["x"])
    with pytest.raises(ValueError, match="feature_names must be a non-empty list"):
        TableConfig(name="t", num_rows=5, dim=2, feature_names=[])
    with pytest.raises(ValueError, match=r"pooling must be one of \('sum', 'mean'\), got 'max'"):
        TableConfig(name="t", num_rows=5, dim=2, feature_names=["x"], pooling="max")  # type: ignore[arg-type]
    a = TableConfig(name="a", num_rows=5, dim=2, feature_names=["x", "y"])
    b = TableConfig(name="b", num_rows=5, dim=2, feature_names=["y"])
    with pytest.raises(ValueError, match="feature 'y' is mapped to two tables, 'a' and 'b'"):
        EmbeddingCollection([a, b])
    spec = a.to_spec()
    assert spec.name == "a" and spec.num_rows == 5 and spec.dim == 2
    assert spec.optimizer == RowWiseAdagrad(lr=0.01)
    bound = math.sqrt(1 / 5)
    assert spec.init is not None and (spec.init.low, spec.init.high) == (-bound, bound)


def test_shared_store_reuses_identical_tables() -> None:
    cfg = TableConfig(name="t", num_rows=5, dim=2, feature_names=["x"], optimizer=ps.SGD(lr=1.0))
    store = ps.InProcessStore()
    train = EmbeddingCollection([cfg], store=store)
    serve = EmbeddingCollection([cfg], store=store).eval()
    kjt = KeyedJaggedIds.from_lists({"x": [[3]]})
    train(kjt)["x"].sum().backward()
    torch.testing.assert_close(serve(kjt)["x"], train(kjt)["x"].detach())
    other = TableConfig(name="t", num_rows=6, dim=2, feature_names=["x"])
    with pytest.raises(ValueError, match="already has a table 't'"):
        EmbeddingCollection([other], store=store)
