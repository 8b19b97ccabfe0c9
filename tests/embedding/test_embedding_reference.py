"""EmbeddingCollection (local and hybrid placements) vs plain torch modules.

The reference (tests/support/embedding_reference.py) keeps one dense ``nn.EmbeddingBag``
/ ``nn.Embedding`` per table, pools each feature separately (no dedup, no
fusion) and applies the optimizer with torch.optim or by hand on the touched
rows. After every step the collection's rows and optimizer state must match.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import ps
from embedding import EmbeddingCollection, KeyedJaggedIds, RowWiseAdagrad, TableConfig
from embedding_reference import Replayed
from tolerance import assert_close, assert_same, sum_tol

pytestmark = [pytest.mark.timeout(120), pytest.mark.numerics]

B = 6  # samples per batch
STEPS = 6
PLACEMENTS = ["local", "hybrid"]
REPLAY_WHY = "a few times the fp32 reference's own rounding error, measured in float64"


def _place(tables: list[TableConfig], placement: str) -> list[TableConfig]:
    return [dataclasses.replace(t, placement=placement) for t in tables]  # type: ignore[arg-type]


def _random_batch(
    gen: torch.Generator, tables: list[TableConfig], weighted: bool, seq_len: int = 3
) -> KeyedJaggedIds:
    """Jagged ids per feature: 0-4 ids per sample (empty bags), drawn from a small
    range so ids repeat within and across samples and features; unpooled features
    get exactly ``seq_len`` ids per sample."""
    lists: dict[str, list[list[int]]] = {}
    for t in tables:
        assert t.num_rows is not None
        for feat in t.feature_names:
            hot = min(t.num_rows, 7)  # ids mostly from a few hot rows, some from anywhere
            samples = []
            for _ in range(B):
                n = (
                    seq_len
                    if t.pooling == "none"
                    else int(torch.randint(0, 5, (1,), generator=gen))
                )
                ids = torch.where(
                    torch.rand(n, generator=gen) < 0.7,
                    torch.randint(0, hot, (n,), generator=gen),
                    torch.randint(0, t.num_rows, (n,), generator=gen),
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


def _loss(
    out: dict[str, torch.Tensor], targets: dict[str, torch.Tensor], use: set[str] | None = None
) -> torch.Tensor:
    total = torch.zeros(())
    for f, o in out.items():
        if use is not None and f not in use:
            continue
        total = total + (o * targets[f][:, : o.shape[1]] if o.dim() == 3 else o * targets[f]).sum()
    return total


def _targets(gen: torch.Generator, tables: list[TableConfig]) -> dict[str, torch.Tensor]:
    out = {}
    for t in tables:
        for f in t.feature_names:
            shape = (B, 3, t.dim) if t.pooling == "none" else (B, t.dim)
            out[f] = torch.randn(*shape, generator=gen)
    return out


def _train_and_compare(
    tables: list[TableConfig],
    placement: str,
    weighted: bool,
    seed: int,
    use: set[str] | None = None,
) -> None:
    """Train both for STEPS batches with a loss over the outputs of ``use`` (None:
    all features; the others get no gradient) and compare after every step."""
    tables = _place(tables, placement)
    gen = torch.Generator().manual_seed(seed)
    ec = EmbeddingCollection(tables)
    rep = Replayed(tables)
    targets = _targets(gen, tables)
    for step in range(STEPS):
        kjt = _random_batch(gen, tables, weighted)
        got = ec(kjt)
        want, want64 = rep.forward(kjt)
        assert list(got) == kjt.keys
        for f in kjt.keys:
            assert got[f].shape == want[f].shape, f
            tol = rep.output_tol(kjt, f, want[f], want64[f])
            assert_close(
                got[f].detach(),
                want[f].detach(),
                atol=tol,
                what=f"{placement} step {step} output {f}",
                why=REPLAY_WHY,
            )
        _loss(got, targets, use).backward()
        _loss(want, targets, use).backward()
        _loss(want64, targets, use).backward()
        rep.step(kjt)
        for t in tables:
            assert t.num_rows is not None
            ids = torch.arange(t.num_rows)
            what = f"{placement} table {t.name} after step {step}"
            assert_close(
                ec.rows(t.name, ids),
                rep.ref.weight[t.name].detach(),
                atol=rep.rows_tol(t.name),
                what=f"{what}: rows",
                why=REPLAY_WHY,
            )
            want_state = rep.ref.state(t.name)
            if want_state is not None:
                assert_close(
                    ec.state(t.name, ids),
                    want_state,
                    atol=rep.state_tol(t.name),
                    what=f"{what}: state",
                    why=REPLAY_WHY,
                )


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("seed", [0, 1])
def test_rowwise_adagrad_sum_and_mean_shared_table(placement: str, seed: int) -> None:
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
        TableConfig(
            name="more", num_rows=9, dim=8, feature_names=["m"], pooling="mean",
            optimizer=RowWiseAdagrad(lr=0.1),
        ),
    ]  # fmt: skip
    _train_and_compare(tables, placement, weighted=False, seed=seed)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_rowwise_adagrad_weighted_sum(placement: str) -> None:
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
    _train_and_compare(tables, placement, weighted=True, seed=3)


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_sgd_matches_torch_optim_sgd(placement: str, pooling: str) -> None:
    tables = [
        TableConfig(
            name="t", num_rows=20, dim=5, feature_names=["x", "y"], pooling=pooling,  # type: ignore[arg-type]
            optimizer=ps.SGD(lr=0.3),
        ),
    ]  # fmt: skip
    _train_and_compare(tables, placement, weighted=False, seed=5)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_adam_and_adagrad_mixed_with_unpooled(placement: str) -> None:
    tables = [
        TableConfig(
            name="tok", num_rows=15, dim=4, feature_names=["seq"], pooling="none",
            optimizer=ps.Adam(lr=0.05),
        ),
        TableConfig(
            name="bag", num_rows=11, dim=4, feature_names=["bag"], pooling="sum",
            optimizer=ps.Adam(lr=0.02, betas=(0.8, 0.99)),
        ),
        TableConfig(
            name="ada", num_rows=10, dim=4, feature_names=["ada", "ada2"], pooling="none",
            optimizer=ps.Adagrad(lr=0.1, initial_accumulator=0.05),
        ),
    ]  # fmt: skip
    _train_and_compare(tables, placement, weighted=False, seed=7)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_unpooled_weighted(placement: str) -> None:
    tables = [
        TableConfig(
            name="tok", num_rows=12, dim=3, feature_names=["seq", "seq2"], pooling="none",
            optimizer=RowWiseAdagrad(lr=0.1),
        ),
        TableConfig(
            name="bag", num_rows=12, dim=3, feature_names=["bag"], pooling="sum",
            optimizer=RowWiseAdagrad(lr=0.1),
        ),
    ]  # fmt: skip
    _train_and_compare(tables, placement, weighted=True, seed=11)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_outputs_partly_used(placement: str) -> None:
    """Features whose outputs the loss ignores get zero gradients: on a table shared
    with a used feature, and a whole table unused ("cats"). The backward reads the
    used outputs' gradients in place and must not mix them up."""
    tables = [
        TableConfig(
            name="items", num_rows=25, dim=6, feature_names=["a", "b", "c"], pooling="sum",
            optimizer=RowWiseAdagrad(lr=0.2),
        ),
        TableConfig(
            name="cats", num_rows=9, dim=6, feature_names=["d"], pooling="mean",
            optimizer=RowWiseAdagrad(lr=0.1),
        ),
        TableConfig(
            name="more", num_rows=9, dim=6, feature_names=["e"], pooling="sum",
            optimizer=RowWiseAdagrad(lr=0.1),
        ),
    ]  # fmt: skip
    _train_and_compare(tables, placement, weighted=False, seed=13, use={"b", "e"})


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_eval_and_no_grad_never_update(placement: str) -> None:
    cfg = TableConfig(
        name="t",
        num_rows=10,
        dim=3,
        feature_names=["x"],
        optimizer=ps.SGD(lr=1.0),
        placement=placement,  # type: ignore[arg-type]
    )
    ec = EmbeddingCollection([cfg])
    kjt = KeyedJaggedIds.from_lists({"x": [[1, 2], [2]]})
    ids = torch.arange(10)
    before, before_clocks = ec.rows("t", ids), ec.clocks("t", ids)
    with torch.no_grad():
        out = ec(kjt)["x"]
    assert not out.requires_grad
    ec.eval()
    out = ec(kjt)["x"]
    assert not out.requires_grad
    assert torch.equal(before, ec.rows("t", ids))
    assert torch.equal(before_clocks, ec.clocks("t", ids))
    ec.train()
    ec(kjt)["x"].sum().backward()
    assert ec.clocks("t", ids).tolist() == [0, 1, 1, 0, 0, 0, 0, 0, 0, 0]


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_pooled_values_by_hand(placement: str) -> None:
    cfg = TableConfig(
        name="t",
        num_rows=5,
        dim=2,
        feature_names=["x", "y"],
        pooling="mean",
        placement=placement,  # type: ignore[arg-type]
    )
    ec = EmbeddingCollection([cfg])
    w = ec.rows("t", torch.arange(5))
    out = ec(KeyedJaggedIds.from_lists({"y": [[4], []], "x": [[1, 1, 3], [0]]}))
    assert list(out) == ["y", "x"]
    one = "a mean bag of one id is that row times 1/1, an empty bag zeros: no rounding"
    assert_same(out["y"], torch.stack([w[4], torch.zeros(2)]), what="bags y", why=one)
    assert_same(out["x"][1], w[0], what="bag x[1]", why=one)
    # x[0]: the collection sums w_i * (1/3) (1/3 rounded), the expected value is
    # (2 w1 + w3) / 3: at most 5 roundings (3 products or terms, 1/3, the division)
    # of terms of magnitude at most max |w| in all.
    assert_close(
        out["x"][0],
        (2 * w[1] + w[3]) / 3,
        atol=sum_tol(torch.float32, 5, float(w.abs().max())),
        what="bag x[0]",
        why="one mean of 3 rows in two orders",
    )


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_unpooled_shapes_and_ragged_error(placement: str) -> None:
    cfg = TableConfig(
        name="tok",
        num_rows=9,
        dim=2,
        feature_names=["seq"],
        pooling="none",
        placement=placement,  # type: ignore[arg-type]
    )
    ec = EmbeddingCollection([cfg])
    w = ec.rows("tok", torch.arange(9))
    out = ec(KeyedJaggedIds.from_lists({"seq": [[1, 2, 3], [4, 4, 0]]}))["seq"]
    assert out.shape == (2, 3, 2)
    assert_same(
        out,
        w[torch.tensor([[1, 2, 3], [4, 4, 0]])],
        what="unpooled lookup",
        why="an unpooled id is a bag of one id with weight 1: its row, copied",
    )
    empty = ec(KeyedJaggedIds.from_lists({"seq": [[], []]}))["seq"]
    assert empty.shape == (2, 0, 2)
    with pytest.raises(
        ValueError,
        match=r"feature 'seq' of table 'tok' has pooling='none', which needs the same number "
        r"of ids in every sample, got lengths \[1, 2\]",
    ):
        ec(KeyedJaggedIds.from_lists({"seq": [[1, 2], [3]]}))


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_local_and_hybrid_train_identically(placement: str) -> None:
    """The fused local path and the store path run the same ps optimizer math; the store
    path sums the row gradients in another order (and row-wise Adagrad runs in the C
    kernel on the local path), so against another local collection the rows are equal
    bit for bit and against a hybrid one within the rounding error the float64 replay
    of the reference measures on the same batches."""
    tables = [
        TableConfig(
            name="a", num_rows=50, dim=8, feature_names=["a1", "a2"],
            optimizer=RowWiseAdagrad(lr=0.1),
        ),
        TableConfig(name="b", num_rows=20, dim=8, feature_names=["b"], pooling="mean",
                    optimizer=ps.Adam(lr=0.01)),
    ]  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    local = EmbeddingCollection(_place(tables, "local"))
    other = EmbeddingCollection(_place(tables, placement))
    rep = Replayed(tables)
    targets = _targets(gen, tables)
    for _ in range(4):
        kjt = _random_batch(gen, tables, weighted=False)
        _loss(local(kjt), targets).backward()
        _loss(other(kjt), targets).backward()
        want, want64 = rep.forward(kjt)
        _loss(want, targets).backward()
        _loss(want64, targets).backward()
        rep.step(kjt)
    for t in tables:
        ids = torch.arange(t.num_rows or 0)
        what = f"table {t.name}: local vs {placement} rows"
        if placement == "local":
            assert_same(
                other.rows(t.name, ids),
                local.rows(t.name, ids),
                what=what,
                why="two local collections: the same kernels on the same batches",
            )
        else:
            assert_close(
                other.rows(t.name, ids),
                local.rows(t.name, ids),
                atol=rep.rows_tol(t.name),
                what=what,
                why=REPLAY_WHY,
            )
        assert torch.equal(local.clocks(t.name, ids), other.clocks(t.name, ids))


def test_config_validation_and_feature_conflicts() -> None:
    with pytest.raises(ValueError, match=r"table 't': dim must be an int > 0, got 0"):
        TableConfig(name="t", num_rows=5, dim=0, feature_names=["x"])
    with pytest.raises(ValueError, match=r"table 't': num_rows must be an int > 0, got -1"):
        TableConfig(name="t", num_rows=-1, dim=2, feature_names=["x"])
    with pytest.raises(ValueError, match="feature_names must be a non-empty list"):
        TableConfig(name="t", num_rows=5, dim=2, feature_names=[])
    with pytest.raises(
        ValueError, match=r"pooling must be one of \('sum', 'mean', 'none'\), got 'max'"
    ):
        TableConfig(name="t", num_rows=5, dim=2, feature_names=["x"], pooling="max")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"placement must be one of .*, got 'gpu'"):
        TableConfig(name="t", num_rows=5, dim=2, feature_names=["x"], placement="gpu")  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"num_rows=None \(a dynamic table\) needs placement='hybrid'"
    ):
        TableConfig(name="t", num_rows=None, dim=2, feature_names=["x"])
    dyn = TableConfig(name="t", num_rows=None, dim=2, feature_names=["x"], placement="hybrid")
    assert dyn.dynamic and dyn.to_spec().dynamic
    a = TableConfig(name="a", num_rows=5, dim=2, feature_names=["x", "y"])
    b = TableConfig(name="b", num_rows=5, dim=2, feature_names=["y"])
    with pytest.raises(ValueError, match="feature 'y' is mapped to two tables, 'a' and 'b'"):
        EmbeddingCollection([a, b])
    spec = a.to_spec()
    assert spec.name == "a" and spec.num_rows == 5 and spec.dim == 2
    assert spec.optimizer == RowWiseAdagrad(lr=0.01)
    bound = math.sqrt(1 / 5)
    assert spec.init is not None and (spec.init.low, spec.init.high) == (-bound, bound)


def test_dynamic_hybrid_table_takes_any_id() -> None:
    cfg = TableConfig(
        name="d",
        num_rows=None,
        dim=3,
        feature_names=["x"],
        placement="hybrid",
        optimizer=ps.SGD(lr=1.0),
    )
    ec = EmbeddingCollection([cfg])
    kjt = KeyedJaggedIds.from_lists({"x": [[10**12, -5], [7]]})
    ec(kjt)["x"].sum().backward()
    assert ec.clocks("d", torch.tensor([10**12, -5, 7, 8])).tolist() == [1, 1, 1, 0]


def test_shared_store_reuses_identical_tables() -> None:
    cfg = TableConfig(
        name="t",
        num_rows=5,
        dim=2,
        feature_names=["x"],
        optimizer=ps.SGD(lr=1.0),
        placement="hybrid",
    )
    store = ps.InProcessStore()
    train = EmbeddingCollection([cfg], store=store)
    serve = EmbeddingCollection([cfg], store=store).eval()
    kjt = KeyedJaggedIds.from_lists({"x": [[3]]})
    train(kjt)["x"].sum().backward()
    assert_same(
        serve(kjt)["x"],
        train(kjt)["x"].detach(),
        what="serving vs training collection",
        why="both read the same row of the one store and pool it by the same code",
    )
    other = dataclasses.replace(cfg, num_rows=6)
    with pytest.raises(ps.TableSpecMismatch, match="table 't' already exists .* 5 x 2 .* 6 x 2"):
        EmbeddingCollection([other], store=store)


def test_mixed_placements_keep_key_order() -> None:
    tables = [
        TableConfig(name="l", num_rows=6, dim=2, feature_names=["a", "c"]),
        TableConfig(name="h", num_rows=6, dim=2, feature_names=["b"], placement="hybrid"),
    ]
    ec = EmbeddingCollection(tables)
    kjt = KeyedJaggedIds.from_lists({"c": [[1]], "b": [[2]], "a": [[3]]})
    out = ec(kjt)
    assert list(out) == ["c", "b", "a"]
    one = "a sum bag of one unweighted id is that row, copied"
    assert_same(out["b"][0], ec.rows("h", torch.tensor([2]))[0], what="hybrid bag", why=one)
    assert_same(out["a"][0], ec.rows("l", torch.tensor([3]))[0], what="local bag", why=one)


def test_save_and_load_local_tables(tmp_path: object) -> None:
    cfg = TableConfig(name="t", num_rows=7, dim=3, feature_names=["x"], optimizer=ps.Adam(lr=0.1))
    ec = EmbeddingCollection([cfg])
    ec(KeyedJaggedIds.from_lists({"x": [[1, 2], [2, 6]]}))["x"].sum().backward()
    path = f"{tmp_path}/ckpt"
    ec.save(path)
    fresh = EmbeddingCollection([cfg])
    ids = torch.arange(7)
    assert not torch.equal(fresh.rows("t", ids), ec.rows("t", ids))
    fresh.load(path)
    for read in ("rows", "state", "clocks"):
        assert torch.equal(getattr(fresh, read)("t", ids), getattr(ec, read)("t", ids)), read
    # The format is the ps checkpoint: a store loads it as a hybrid table.
    store = ps.InProcessStore()
    store.load(path)
    assert torch.equal(store.pull("t", ids).rows, ec.rows("t", ids))
    wrong = EmbeddingCollection([dataclasses.replace(cfg, dim=4)])
    with pytest.raises(ValueError, match=r"table 't' was saved with num_rows=7, dim=3"):
        wrong.load(path)


def test_sharded_placement_routes_to_sharded_module() -> None:
    cfg = TableConfig(name="s", num_rows=7, dim=3, feature_names=["x"], placement="sharded")
    try:
        import embedding.sharded  # noqa: F401
    except ModuleNotFoundError:
        with pytest.raises(NotImplementedError, match=r"tables \['s'\] have placement='sharded'"):
            EmbeddingCollection([cfg])
        return
    ec = EmbeddingCollection([cfg])
    assert ec.sharded is not None


def test_prefetch_through_a_cache_and_store_kind() -> None:
    from cache import CacheConfig, CachedStore

    cfg = TableConfig(
        name="t",
        num_rows=50,
        dim=4,
        feature_names=["x", "y"],
        placement="hybrid",
        optimizer=ps.SGD(lr=0.5),
    )
    local = TableConfig(name="l", num_rows=5, dim=4, feature_names=["z"])
    cached = CachedStore(ps.InProcessStore(), CacheConfig(capacity_rows=20, prefetch="on"))
    ec = EmbeddingCollection([cfg, local], store=cached)
    assert ec.hybrid is not None and not ec.hybrid.store_is_shared  # a cache over a per-rank store
    kjt = KeyedJaggedIds.from_lists({"x": [[1, 2], [3]], "y": [[2, 9], []], "z": [[1], [1]]})
    nxt = KeyedJaggedIds.from_lists({"x": [[4, 2], [6]], "y": [[4, 7], []], "z": [[0], [1]]})
    ec.prefetch(nxt)  # the next batch's ids of table t, [2, 4, 6, 7], ride on kjt's pull
    ec(kjt)["x"].sum().backward()
    assert cached.cache_stats()["t"]["prefetched"] == 0
    ec(nxt)["x"].sum().backward()
    # 4, 6 and 7 came with the first pull; 2 was asked by that pull itself.
    assert cached.cache_stats()["t"]["prefetched"] == 3
    assert cached.request_counts()["pull_messages"] == 2  # one per batch, prefetch included
    plain = EmbeddingCollection([cfg, local])  # no prefetch method: prefetch does nothing
    w0 = plain.rows("t", torch.arange(50))
    plain.prefetch(nxt)
    plain(kjt)["x"].sum().backward()
    plain(nxt)["x"].sum().backward()
    cached.flush()
    ids = torch.arange(50)
    # Each row is w0 - lr g1 - lr g2 with gradients of x.sum() (each 0 or 1): the cache and
    # the store may apply SGD's add_(g, alpha=-lr) fused or not (on other layouts), so
    # a sum of 3 terms in two roundings of its products.
    assert_close(
        ec.rows("t", ids),
        plain.rows("t", ids),
        atol=sum_tol(torch.float32, 3, float(w0.abs().max()) + 2 * 0.5),
        what="cached vs plain rows",
        why="one SGD sum of 3 terms, products fused or not",
    )
    shared = EmbeddingCollection([cfg], store=cached, store_is_shared=True)
    assert shared.hybrid is not None and shared.hybrid.store_is_shared
