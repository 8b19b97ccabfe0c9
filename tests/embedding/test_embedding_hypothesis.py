"""Random jagged batches (empty bags, repeated ids, per-id weights, unpooled
sequences, batch size 0) through the local and hybrid placements, against the
plain-torch reference of tests/support/embedding_reference.py: outputs, then rows and
optimizer state after two training steps, each within a few times the fp32 reference's
own rounding error, measured by replaying it in float64 (``Replayed``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ps
from embedding import EmbeddingCollection, KeyedJaggedIds, RowWiseAdagrad, TableConfig
from embedding_reference import Replayed
from tolerance import assert_close

pytestmark = [pytest.mark.timeout(240), pytest.mark.numerics]

TABLES = [
    TableConfig(
        name="a", num_rows=6, dim=3, feature_names=["a1", "a2"], pooling="sum",
        optimizer=RowWiseAdagrad(lr=0.3),
    ),
    TableConfig(name="b", num_rows=4, dim=3, feature_names=["b"], pooling="mean",
                optimizer=ps.Adam(lr=0.1)),
    TableConfig(name="c", num_rows=5, dim=2, feature_names=["c"], pooling="none",
                optimizer=ps.SGD(lr=0.5)),
]  # fmt: skip
WEIGHTED_TABLES = [t for t in TABLES if t.pooling != "mean"]
WHY = "a few times the fp32 reference's own rounding error, measured in float64"


@st.composite
def batches(draw: st.DrawFn, tables: list[TableConfig], weighted: bool) -> KeyedJaggedIds:
    b = draw(st.integers(0, 4))
    seq = draw(st.integers(0, 3))
    lists: dict[str, list[list[int]]] = {}
    for t in tables:
        assert t.num_rows is not None
        ids = st.integers(0, t.num_rows - 1)
        for f in t.feature_names:
            if draw(st.booleans()) and f != "a1":  # features may be absent from a batch
                continue
            samples = []
            for _ in range(b):
                n = seq if t.pooling == "none" else draw(st.integers(0, 4))
                samples.append(draw(st.lists(ids, min_size=n, max_size=n)))
            lists[f] = samples
    keys = list(lists)
    order = draw(st.permutations(keys))
    lists = {k: lists[k] for k in order}
    if not weighted:
        return KeyedJaggedIds.from_lists(lists)
    weight = st.floats(-2.0, 2.0, allow_nan=False, width=32)
    w = {f: [[draw(weight) for _ in s] for s in v] for f, v in lists.items()}
    return KeyedJaggedIds.from_lists(lists, weights=w)


def _check(tables: list[TableConfig], placement: str, kjts: list[KeyedJaggedIds]) -> None:
    tables = [dataclasses.replace(t, placement=placement) for t in tables]  # type: ignore[arg-type]
    ec = EmbeddingCollection(tables)
    rep = Replayed(tables)
    gen = torch.Generator().manual_seed(0)
    for step, kjt in enumerate(kjts):
        got = ec(kjt)
        want, want64 = rep.forward(kjt)
        assert list(got) == kjt.keys
        losses = [torch.zeros(()), torch.zeros(()), torch.zeros((), dtype=torch.float64)]
        for f in kjt.keys:
            assert got[f].shape == want[f].shape, (f, got[f].shape, want[f].shape)
            assert_close(
                got[f].detach(),
                want[f].detach(),
                atol=rep.output_tol(kjt, f, want[f], want64[f]),
                what=f"{placement} step {step} output {f}",
                why=WHY,
            )
            target = torch.randn(got[f].shape, generator=gen)
            for i, out in enumerate((got[f], want[f], want64[f])):
                losses[i] = losses[i] + (out * target).sum()
        for loss in losses:
            if loss.requires_grad:
                loss.backward()
        rep.step(kjt)
    for t in tables:
        ids = torch.arange(t.num_rows or 0)
        assert_close(
            ec.rows(t.name, ids),
            rep.ref.weight[t.name].detach(),
            atol=rep.rows_tol(t.name),
            what=f"{placement} table {t.name} rows",
            why=WHY,
        )
        want_state = rep.ref.state(t.name)
        if want_state is not None:
            assert_close(
                ec.state(t.name, ids),
                want_state,
                atol=rep.state_tol(t.name),
                what=f"{placement} table {t.name} state",
                why=WHY,
            )


@pytest.mark.parametrize("placement", ["local", "hybrid"])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_random_batches_unweighted(placement: str, data: st.DataObject) -> None:
    kjts = [data.draw(batches(TABLES, weighted=False)) for _ in range(2)]
    _check(TABLES, placement, kjts)


@pytest.mark.parametrize("placement", ["local", "hybrid"])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_random_batches_weighted(placement: str, data: st.DataObject) -> None:
    kjts = [data.draw(batches(WEIGHTED_TABLES, weighted=True)) for _ in range(2)]
    _check(WEIGHTED_TABLES, placement, kjts)
