"""Server-side optimizers of the in-process store against independent references.

See tests/support/ps_reference.py: torch.optim (SGD, SGD momentum per row, Adagrad, SparseAdam per
row) or the published rule in plain Python floats (row-wise Adagrad, FTRL, Adam with
weight decay). Several pushes, duplicate ids in a push, untouched rows, fixed and dynamic
tables; tolerances from the reference's float32 run against its float64 replay
(``ps_reference.Replay``).
"""

from __future__ import annotations

import json

import pytest
import torch

import ps
from ps_reference import assert_matches_reference
from tolerance import assert_same

pytestmark = [pytest.mark.timeout(60), pytest.mark.numerics]

ROWS, DIM = 12, 5

OPTIMIZERS = [
    ps.SGD(lr=0.3),
    ps.SGD(lr=0.2, momentum=0.9),
    ps.Adagrad(lr=0.5, eps=1e-10, initial_accumulator=0.1),
    ps.Adam(lr=0.05, betas=(0.9, 0.99), eps=1e-6),
    ps.Adam(lr=0.05, betas=(0.8, 0.999), eps=1e-8, weight_decay=0.1),
    ps.RowWiseAdagrad(lr=0.3, eps=1e-4, initial_accumulator=0.2),
    ps.FTRL(alpha=0.5, beta=1.0, l1=0.05, l2=0.1),
    ps.FTRL(alpha=0.1, beta=0.0, l1=0.0, l2=0.0),
]


def _pushes(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Five pushes over rows 0..ROWS-1: repeats inside a push, rows 10 and 11 never touched."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for k in range(5):
        ids = torch.tensor([k % 3, 3, 4 + k % 2, 3, 7, 9 - k % 2, k % 3, 8])  # 3 twice, k%3 twice
        grads = torch.randn(ids.numel(), DIM, generator=gen) * 0.7
        out.append((ids, grads))
    out.append((torch.tensor([5, 5, 5]), torch.randn(3, DIM, generator=gen)))
    out.append((torch.empty(0, dtype=torch.int64), torch.empty(0, DIM)))
    return out


@pytest.mark.parametrize("dynamic", [False, True], ids=["fixed", "dynamic"])
@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: json.dumps(o.to_json()))
def test_optimizer_matches_reference(opt: ps.Optimizer, dynamic: bool) -> None:
    # A dynamic table keyed by scattered int64 ids (negative too) must behave exactly
    # like a fixed one: row r of the reference is id key[r].
    key = torch.arange(ROWS) * 7_919_000_003 - 10**15 if dynamic else torch.arange(ROWS)
    store = ps.InProcessStore()
    spec = ps.TableSpec(name="t", num_rows=None if dynamic else ROWS, dim=DIM, optimizer=opt)
    store.create_table(spec)
    w0 = store.pull("t", key).rows.clone()  # [R, D] initial rows
    assert_same(w0, spec.initial_rows(key), what="initial rows", why="the same initializer")
    pushes = _pushes(seed=3)
    for ids, grads in pushes:
        store.push("t", key[ids], grads)
    assert_matches_reference(store, "t", key, opt, w0, pushes, ROWS)


def test_lazy_momentum_differs_from_dense_torch_sgd() -> None:
    # Documented semantics: a row not in a push keeps its momentum buffer and its value;
    # dense torch SGD would move it by the decayed buffer.
    store = ps.InProcessStore()
    store.create_table(
        ps.TableSpec(name="t", num_rows=2, dim=1, optimizer=ps.SGD(lr=1.0, momentum=0.5))
    )
    w0 = store.pull("t", torch.arange(2)).rows.clone()
    store.push("t", torch.tensor([0]), torch.ones(1, 1))
    store.push("t", torch.tensor([1]), torch.ones(1, 1))
    got = store.pull("t", torch.arange(2)).rows
    # each row: one step of -lr * g
    assert_same(got, w0 - 1.0, what="rows", why="lr * g = 1 is exact: one rounding, as w0 - 1.0")
    assert store.state("t", torch.arange(2)).flatten().tolist() == [1.0, 1.0]


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: o.name)
def test_json_round_trip(opt: ps.Optimizer) -> None:
    data = opt.to_json()
    text = json.dumps(data)
    assert ps.optimizer_from_json(text) == opt
    assert ps.Optimizer.from_json(json.loads(text)) == opt
    spec = ps.TableSpec(name="x", num_rows=None, dim=3, optimizer=opt, capacity=9)
    assert ps.TableSpec.from_json(json.dumps(spec.to_json())) == spec


def test_state_dims() -> None:
    assert ps.SGD(lr=1.0).state_dim(8) == 0
    assert ps.SGD(lr=1.0, momentum=0.1).state_dim(8) == 8
    assert ps.RowWiseAdagrad(lr=1.0).state_dim(8) == 1
    assert ps.Adagrad(lr=1.0).state_dim(8) == 8
    assert ps.Adam().state_dim(8) == 17
    assert ps.FTRL(alpha=1.0).state_dim(8) == 16


@pytest.mark.parametrize(
    "make,exc,msg",
    [
        (lambda: ps.SGD(lr=0.1, momentum=1.0), ValueError, r"SGD: momentum must be in \[0, 1\)"),
        (lambda: ps.SGD(lr=float("nan")), ValueError, "SGD: lr must be finite, got nan"),
        (lambda: ps.SGD(lr="0.1"), TypeError, "SGD: lr must be a number, got str"),
        (lambda: ps.Adagrad(lr=0.1, eps=0), ValueError, "Adagrad: eps must be a finite number > 0"),
        (lambda: ps.Adam(betas=(0.9,)), ValueError, r"Adam: betas must be a pair"),
        (lambda: ps.Adam(betas=(0.9, 1.0)), ValueError, r"Adam: betas\[1\] must be in \[0, 1\)"),
        (lambda: ps.Adam(weight_decay=-1), ValueError, "Adam: weight_decay must be a finite"),
        (lambda: ps.FTRL(alpha=0), ValueError, "FTRL: alpha must be a finite number > 0, got 0"),
        (lambda: ps.FTRL(alpha=1, l1=-0.5), ValueError, "FTRL: l1 must be a finite number >= 0"),
        (
            lambda: ps.optimizer_from_json({"type": "lamb", "lr": 1}),
            ValueError,
            "unknown type 'lamb'",
        ),
        (
            lambda: ps.optimizer_from_json({"type": "sgd", "lr": 1, "nesterov": True}),
            ValueError,
            r"'sgd' has no fields \['nesterov'\]",
        ),
    ],
)
def test_config_validation(make, exc, msg) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(exc, match=msg):
        make()
