"""Tables as module state: ``state_dict`` / ``load_state_dict`` / ``torch.save`` /
``.to()`` of an EmbeddingCollection, and one ``save`` / ``load`` for every placement.

Every round trip is checked against the collection it came from: equal rows,
optimizer state and clocks, and an equal next training step.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import ps
from cache import CacheConfig, CachedStore
from embedding import EmbeddingCollection, KeyedJaggedIds, TableConfig
from tolerance import assert_close, sum_tol

pytestmark = [pytest.mark.timeout(120), pytest.mark.numerics]

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
OPT = ps.Adam(lr=0.05)
# One step of a collection and of its copy in the same placements runs the same kernels on
# the same values in the same layout: bit for bit on the CPU. On a GPU a backward kernel
# adds with float atomics, in any order: one Adam step's rounding (see _step_tol).
EXACT_ON = {"cpu": True, "cuda": False}
# At most this many roundings in one Adam step of an element (m, v, sqrt(v), + eps, the
# step size, the quotient, its product and the sum) after a gradient of up to 3 terms.
STEP_ROUNDINGS = 11


def _tables(placements: tuple[str, str, str] = ("local", "local", "local")) -> list[TableConfig]:
    a, b, c = placements
    return [
        TableConfig(name="a", num_rows=9, dim=3, feature_names=["x", "y"], optimizer=OPT,
                    placement=a),  # type: ignore[arg-type]
        TableConfig(name="b", num_rows=6, dim=3, feature_names=["z"], optimizer=OPT,
                    pooling="mean", placement=b),  # type: ignore[arg-type]
        TableConfig(name="c", num_rows=5, dim=2, feature_names=["w"], optimizer=OPT,
                    placement=c),  # type: ignore[arg-type]
    ]  # fmt: skip


def _batch(step: int) -> KeyedJaggedIds:
    gen = torch.Generator().manual_seed(step)
    lists = {}
    for f, rows in (("x", 9), ("y", 9), ("z", 6), ("w", 5)):
        lists[f] = [torch.randint(0, rows, (int(n),), generator=gen).tolist() for n in (2, 1, 3)]
    return KeyedJaggedIds.from_lists(lists)


def _step(ec: EmbeddingCollection, step: int) -> dict[str, torch.Tensor]:
    out = ec(_batch(step))
    sum((o * (i + 1)).sum() for i, o in enumerate(out.values())).backward()  # type: ignore[union-attr]
    return {k: v.detach() for k, v in out.items()}


def _snapshot(ec: EmbeddingCollection) -> dict[str, torch.Tensor]:
    """Every table whole (rows, state, clocks) on the host, whatever the placement."""
    out = {}
    for t in ec.tables:
        ids = torch.arange(int(t.num_rows or 0))
        if t.placement == "sharded":
            sh = ec.sharded
            got = (sh.full_table(t.name), sh.full_state(t.name), sh.full_clocks(t.name))  # type: ignore[union-attr,operator]
        else:
            if isinstance(ec.store, CachedStore):
                ec.store.flush()
            got = (ec.rows(t.name, ids), ec.state(t.name, ids), ec.clocks(t.name, ids))
        for what, v in zip(("rows", "state", "clocks"), got, strict=True):
            out[f"{t.name}.{what}"] = v.detach().cpu().clone()
    return out


def _assert_same(
    a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tols: dict[str, float] | None = None
) -> None:
    """Equal bit for bit (a round trip copies, the same kernels recompute), or within
    ``tols[k]`` where placements differ (a "mean" bag is an ``embedding_bag`` mean on the
    sharded path and a sum with weights ``1/len`` elsewhere, a cache applies the
    optimizer on other layouts: FMA or not)."""
    assert a.keys() == b.keys()
    for k in a:
        if tols is None:
            assert torch.equal(a[k], b[k]), k
        else:
            assert_close(a[k], b[k], atol=tols[k], what=k, why="one step in two roundings")


def _top(x: torch.Tensor) -> float:
    """``max |x|`` (0 for an empty tensor)."""
    return float(x.abs().max()) if x.numel() else 0.0


def _step_tol(
    before: dict[str, torch.Tensor],
    after: dict[str, torch.Tensor],
    outputs: dict[str, torch.Tensor],
) -> tuple[dict[str, float], dict[str, float]]:
    """Tolerances of one step of two placements from the same state ``before`` (``after``:
    one of them after the step): each table's rows and state are ``x + update``, at most
    :data:`STEP_ROUNDINGS` roundings over ``|x| + |update|``; each pooled output (bags of
    up to 3 ids of weight 1 or ``1/len``: 5 roundings) over 3 times the largest row."""
    state = {
        k: sum_tol(torch.float32, STEP_ROUNDINGS, _top(v) + _top(after[k] - v))
        if v.is_floating_point()
        else 0.0
        for k, v in before.items()
    }
    big = max(_top(v) for k, v in before.items() if k.endswith(".rows"))
    return state, {k: sum_tol(torch.float32, 5, 3 * big) for k in outputs}


def _compare_step(
    a: EmbeddingCollection,
    b: EmbeddingCollection,
    step: int,
    exact: bool,
    run: Callable[[EmbeddingCollection, int], dict[str, torch.Tensor]] = _step,
) -> dict[str, float]:
    """One step (``run``) of ``a`` and ``b`` from the same state: outputs and tables equal
    bit for bit (``exact``) or within :func:`_step_tol`; returns the tables' tolerances."""
    before = _snapshot(b)
    out_a, out_b = run(a, step), run(b, step)
    after_a, after_b = _snapshot(a), _snapshot(b)
    tols, out_tols = _step_tol(before, after_b, out_b)
    _assert_same(out_a, out_b, None if exact else out_tols)
    _assert_same(after_a, after_b, None if exact else tols)
    return tols


def _cached() -> CachedStore:
    return CachedStore(ps.InProcessStore(), CacheConfig(capacity_rows=4))


@pytest.mark.parametrize("device", DEVICES)
def test_local_round_trip_between_groupings_and_through_torch_save(device: str) -> None:
    ec = EmbeddingCollection(_tables(), device=device)
    for s in range(2):
        _step(ec, s)
    sd = ec.state_dict()
    assert sorted(sd) == sorted(
        f"local.{t}.{w}" for t in "abc" for w in ("weight", "state", "clocks")
    )
    assert sd["local.a.weight"].shape == (9, 3) and sd["local.a.state"].shape == (9, 7)
    assert sd["local.c.clocks"].dtype == torch.int64 and sd["local.a.weight"].device.type == device
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    # Tables in another order: other bases in the fused storage, the same per-table keys.
    other = EmbeddingCollection(list(reversed(_tables())), device=device)
    result = other.load_state_dict(loaded, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    _assert_same(_snapshot(other), _snapshot(ec))
    _compare_step(other, ec, 5, exact=EXACT_ON[device])
    # Another grouping: "b" with its own optimizer config is a fused group of its own.
    tables = _tables()
    tables[1] = dataclasses.replace(tables[1], optimizer=ps.Adam(lr=0.01))
    regrouped = EmbeddingCollection(tables, device=device)
    assert regrouped.local is not None and len(regrouped.local.groups) == 3
    regrouped.load_state_dict(ec.state_dict())
    _assert_same(_snapshot(regrouped), _snapshot(ec))


def test_load_state_dict_names_what_is_wrong() -> None:
    ec = EmbeddingCollection(_tables())
    sd = ec.state_dict()
    bad = dict(sd) | {"local.b.weight": torch.zeros(5, 3)}
    with pytest.raises(RuntimeError, match=r"local table 'b': local.b.weight: got .*\(5, 3\), "
                                           r"expected torch.float32 \(6, 3\)"):  # fmt: skip
        ec.load_state_dict(bad)
    missing = {k: v for k, v in sd.items() if k != "local.c.clocks"}
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*local.c.clocks"):
        ec.load_state_dict(missing)
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\).*local.zz.weight"):
        ec.load_state_dict(dict(sd) | {"local.zz.weight": torch.zeros(1)})
    result = ec.load_state_dict(missing, strict=False)
    assert result.missing_keys == ["local.c.clocks"]


@pytest.mark.parametrize("device", DEVICES)
def test_to_moves_the_tables_and_training_goes_on(device: str) -> None:
    """Built on the host, moved with ``.to(device)`` (inside a model): the fused groups
    and shards train on the moved tensors, equal to a collection built there; a dtype
    cast of the model leaves the tables float32; ``to_empty`` + ``load_state_dict``
    (the meta-device pattern) restores a collection exactly."""
    placements = ("local", "sharded", "hybrid")
    moved = nn.ModuleDict(
        {"emb": EmbeddingCollection(_tables(placements)), "head": nn.Linear(2, 1)}
    )
    moved.to(device)
    ec = moved["emb"]
    assert isinstance(ec, EmbeddingCollection) and ec.device.type == device
    assert ec.local is not None and ec.local.groups[0].weight is ec.local.group0_weight
    assert ec.local.group0_weight.device.type == device
    built = EmbeddingCollection(_tables(placements), device=device)
    for s in range(2):  # the tables after each step, so after the last one too
        _compare_step(ec, built, s, exact=EXACT_ON[device])
    moved.to(torch.float64)
    assert moved["head"].weight.dtype == torch.float64
    assert ec.local.group0_weight.dtype == torch.float32
    assert ec.local.group0_clocks.dtype == torch.int64
    keys = [k for k in moved.state_dict() if k.startswith("emb.")]
    assert {"emb.local.a.weight", "emb.sharded.b.ids", "emb.hybrid.c.ids"} <= set(keys)
    sd = {k: v.clone() for k, v in ec.state_dict().items()}
    ec.to_empty(device=device)
    ec.load_state_dict(sd)
    assert ec.local.groups[0].weight is ec.local.group0_weight
    _compare_step(ec, built, 7, exact=EXACT_ON[device])


@pytest.mark.parametrize("device", DEVICES)
def test_sharded_and_hybrid_state_dicts_round_trip(device: str) -> None:
    """Sharded entries carry their global row ids (a dict with rows in another order
    loads the same); hybrid entries are the store's rows (fixed and dynamic tables,
    behind a cache) and loading them replaces the store's tables."""
    tables = _tables(("hybrid", "hybrid", "sharded"))
    tables.append(TableConfig(name="d", num_rows=None, dim=2, feature_names=["v"],
                              optimizer=OPT, placement="hybrid"))  # fmt: skip
    kjt_v = KeyedJaggedIds.from_lists({"v": [[10**12, 3], [7]]})

    def step(ec: EmbeddingCollection, s: int) -> dict[str, torch.Tensor]:
        out = _step(ec, s)
        ec(kjt_v)["v"].sum().backward()
        return out

    ec = EmbeddingCollection(tables, store=_cached(), device=device)
    for s in range(2):
        step(ec, s)
    sd = ec.state_dict()
    assert sorted(sd) == sorted(
        f"{p}.{t}.{w}"
        for p, t in (("hybrid", "a"), ("hybrid", "b"), ("sharded", "c"), ("hybrid", "d"))
        for w in ("ids", "weight", "state", "clocks")
    )
    assert sd["hybrid.d.ids"].tolist() == [3, 7, 10**12]  # the rows the dynamic table holds
    assert torch.equal(sd["sharded.c.ids"], torch.arange(5))
    perm = torch.tensor([3, 0, 4, 1, 2])
    for w in ("ids", "weight", "state", "clocks"):
        sd[f"sharded.c.{w}"] = sd[f"sharded.c.{w}"][perm.to(sd[f"sharded.c.{w}"].device)]
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    other = EmbeddingCollection(tables, store=_cached(), device=device)
    other.load_state_dict(torch.load(buf, weights_only=True))
    _assert_same(_snapshot(other), _snapshot(ec))
    assert torch.equal(
        other.rows("d", torch.tensor([10**12])), ec.rows("d", torch.tensor([10**12]))
    )
    _compare_step(other, ec, 4, exact=EXACT_ON[device], run=step)
    with pytest.raises(RuntimeError, match=r"hybrid table 'a'"):
        other.load_state_dict(dict(sd) | {"hybrid.a.weight": torch.zeros(9, 2)})


@pytest.mark.parametrize("device", DEVICES)
def test_save_and_load_cover_every_placement(device: str, tmp_path: Path) -> None:
    """One checkpoint holds local, hybrid (behind a cache) and sharded tables; it loads
    into a collection with every table in another placement, into a store, and back."""
    src = EmbeddingCollection(
        _tables(("local", "hybrid", "sharded")), store=_cached(), device=device
    )
    for s in range(3):
        _step(src, s)
    src.save(tmp_path / "ckpt")
    swapped = EmbeddingCollection(
        _tables(("hybrid", "sharded", "local")), store=_cached(), device=device
    )
    _step(swapped, 9)  # its cache holds copies that the load must void
    swapped.load(tmp_path / "ckpt")
    _assert_same(_snapshot(swapped), _snapshot(src))
    tols = _compare_step(swapped, src, 4, exact=False)
    store = ps.InProcessStore()
    store.load(tmp_path / "ckpt")  # a store reads the same format
    assert store.tables() == ["a", "b", "c"]
    swapped.save(tmp_path / "again")
    hybrid_only = EmbeddingCollection(_tables(("hybrid", "hybrid", "hybrid")), device=device)
    hybrid_only.load(tmp_path / "again")
    hybrid_only.save(tmp_path / "hybrid")
    local = EmbeddingCollection(_tables(), device=device)
    local.load(tmp_path / "hybrid")
    _assert_same(_snapshot(local), _snapshot(src), tols)  # swapped's rows after its step
    with pytest.raises(ValueError, match="table 'b' was saved with num_rows=6"):
        EmbeddingCollection(
            [*_tables()[:1], dataclasses.replace(_tables()[1], num_rows=4), _tables()[2]]
        ).load(tmp_path / "hybrid")


def test_tables_left_out_of_a_model_state_dict() -> None:
    model = nn.ModuleDict({"emb": EmbeddingCollection(_tables(("local", "hybrid", "sharded"))),
                           "head": nn.Linear(2, 1)})  # fmt: skip
    ec = model["emb"]
    assert isinstance(ec, EmbeddingCollection)
    with ec.tables_left_out():
        assert sorted(model.state_dict()) == ["head.bias", "head.weight"]
        model.load_state_dict(
            {"head.weight": torch.zeros(1, 2), "head.bias": torch.zeros(1)}, strict=True
        )
    assert len(model.state_dict()) == 2 + 4 * 3 - 1  # local: no ids entry
