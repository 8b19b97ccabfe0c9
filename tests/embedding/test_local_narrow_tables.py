"""Local tables of fp16 and bf16 rows (``TableConfig(dtype=...)``, placement "local").

The reference is the in-process ps store with the same specs: its narrow tables are the
definition (a widened row, the optimizer's ``apply`` in float32, the result rounded by
:func:`ps.rounding.round_to` keyed by the table's init seed, the row's id and its clock
after the update; ``tests/ps/test_ps_narrow_tables.py`` checks it against plain torch).
The batches use every row of a table at most once per step, in sum bags of unit
weight, so a row's summed gradient is its bag's gradient exactly on both sides and the
store is pushed exactly those. The lookups are checked against ``F.embedding_bag`` on
the store's rows widened (plain torch, float32).

Row-wise Adagrad on the host runs the narrow C pass (ps/kernels/narrow_rows.c): the
float32 C kernel's step on the widened row, then the rounding. The store's narrow path
runs the optimizer's torch ``apply``, whose float32 bits differ from the C kernel's by
an ulp here and there; so that optimizer is compared to the store bit for bit with the
kernels off (both torch), and with them on against the float32 C kernel on widened rows
followed by ``round_to`` (bit for bit) and against the store within a step of the
narrow type per update.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import ps
from embedding import EmbeddingCollection, KeyedJaggedIds, TableConfig
from embedding.fused_ops import FusedGroup
from multiproc import run_ranks
from ps.kernels import narrow_rows, rowwise_adagrad
from ps.rounding import round_to
from tolerance import assert_close, assert_same, sum_tol

pytestmark = [pytest.mark.timeout(120), pytest.mark.numerics]

B = 6  # samples per batch
STEPS = 5
NARROW = {"fp16": torch.float16, "bf16": torch.bfloat16}
#: One step of the narrow type relative to a value's magnitude (2**-10 fp16, 2**-7 bf16).
STEP = {"fp16": 2.0**-10, "bf16": 2.0**-7}
OPTIMIZERS = {
    "sgd": ps.SGD(lr=0.05),
    "sgd_momentum": ps.SGD(lr=0.05, momentum=0.9),
    "rowwise_adagrad": ps.RowWiseAdagrad(lr=0.05),
    "adagrad": ps.Adagrad(lr=0.05),
    "adam": ps.Adam(lr=0.01),
    "ftrl": ps.FTRL(alpha=0.1, l1=0.001, l2=0.001),
}
SAME_MATH = (
    "the same float32 operations on the same widened rows and summed gradients, rounded by "
    "the same keys (table seed, row id, clock after the update)"
)


def _tables(opt: ps.Optimizer, dtype: str) -> list[TableConfig]:
    """Two tables of one fused group (two seeds, two bases), one with two features."""
    return [
        TableConfig(
            name="a", num_rows=48, dim=8, feature_names=["a1", "a2"], optimizer=opt, dtype=dtype
        ),  # type: ignore[arg-type]
        TableConfig(name="b", num_rows=30, dim=8, feature_names=["b"], optimizer=opt, dtype=dtype),  # type: ignore[arg-type]
    ]


@dataclasses.dataclass
class Step:
    kjt: KeyedJaggedIds
    targets: dict[str, torch.Tensor]  # feature -> [B, D]: the gradient of its pooled output
    pushes: dict[str, tuple[torch.Tensor, torch.Tensor]]  # table -> (ids [N], grads [N, D])


def _distinct_step(gen: torch.Generator, tables: list[TableConfig]) -> Step:
    """Sum bags of 0-3 ids per sample; a row of a table appears at most once in the step."""
    lists: dict[str, list[list[int]]] = {}
    targets: dict[str, torch.Tensor] = {}
    pushes = {}
    for t in tables:
        assert t.num_rows is not None
        order = torch.randperm(t.num_rows, generator=gen).tolist()
        at = 0
        ids: list[int] = []
        grads: list[torch.Tensor] = []
        for feat in t.feature_names:
            target = torch.randn(B, t.dim, generator=gen)
            samples = []
            for b in range(B):
                n = int(torch.randint(0, 4, (1,), generator=gen))
                bag = order[at : at + n]
                at += len(bag)
                samples.append(bag)
                ids += bag
                grads += [target[b]] * len(bag)
            lists[feat], targets[feat] = samples, target
        stacked = torch.stack(grads) if grads else torch.zeros(0, t.dim)
        pushes[t.name] = (torch.tensor(ids, dtype=torch.int64), stacked)
    return Step(KeyedJaggedIds.from_lists(lists), targets, pushes)


def _store(tables: list[TableConfig]) -> ps.InProcessStore:
    store = ps.InProcessStore()
    for t in tables:
        store.create_table(t.to_spec())
    return store


def _loss(out: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]) -> torch.Tensor:
    return sum((out[f] * targets[f]).sum() for f in out)  # type: ignore[return-value]


def _check_lookup(
    out: dict[str, torch.Tensor], step: Step, tables: list[TableConfig], rows: dict
) -> None:
    """Each pooled output against ``F.embedding_bag`` on the widened rows ``rows[table]``."""
    for t in tables:
        for feat in t.feature_names:
            sub = step.kjt.key_slice(feat)
            want = F.embedding_bag(
                sub.ids, rows[t.name], sub.offsets(), mode="sum", include_last_offset=True
            )
            mag = F.embedding_bag(
                sub.ids, rows[t.name].abs(), sub.offsets(), mode="sum", include_last_offset=True
            )
            assert out[feat].dtype == torch.float32
            assert_close(
                out[feat],
                want,
                atol=sum_tol(torch.float32, 3, float(mag.amax()) if mag.numel() else 0.0),
                what=f"lookup {feat}",
                why="one float32 sum of at most 3 rows in two orders",
            )


def _assert_like_store(ec: EmbeddingCollection, store: ps.Store, tables: list[TableConfig]) -> None:
    for t in tables:
        ids = torch.arange(t.num_rows or 0)
        (want,) = store.pull_many([ps.PullRequest(t.name, ids, with_state=True)])
        assert want.state is not None
        assert_same(ec.rows(t.name, ids), want.rows, what=f"{t.name} rows", why=SAME_MATH)
        assert ec.local is not None
        assert_same(ec.local.state(t.name, ids), want.state, what=f"{t.name} state", why=SAME_MATH)
        assert torch.equal(ec.clocks(t.name, ids), want.clocks)


# (optimizer, C kernels on); row-wise Adagrad with the kernels: both sides run the narrow
# C pass (the store's fixed tables too), so there too the bits are the same.
STORE_CASES = [(o, k) for o in sorted(OPTIMIZERS) for k in (True, False)]


@pytest.mark.parametrize(("opt_name", "kernels"), STORE_CASES)
@pytest.mark.parametrize("dtype", sorted(NARROW))
def test_narrow_local_tables_equal_the_store(
    dtype: str, opt_name: str, kernels: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not kernels:
        monkeypatch.setenv("HYBRIDREC_CPU_KERNEL", "0")  # the torch paths (and round_to)
    tables = _tables(OPTIMIZERS[opt_name], dtype)
    ec = EmbeddingCollection(tables)
    store = _store(tables)
    assert ec.local is not None
    assert [g.weight.dtype for g in ec.local.groups] == [NARROW[dtype]]  # one fused group
    _assert_like_store(ec, store, tables)  # the initial rows, rounded to the nearest
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        step = _distinct_step(gen, tables)
        rows = {t.name: store.pull(t.name, torch.arange(t.num_rows or 0)).rows for t in tables}
        out = ec(step.kjt)
        _check_lookup(out, step, tables, rows)
        _loss(out, step.targets).backward()
        for name, (ids, grads) in step.pushes.items():
            if ids.numel():
                store.push(name, ids, grads)
    _assert_like_store(ec, store, tables)


@pytest.mark.skipif(not narrow_rows.available(), reason="no C compiler: torch path only")
@pytest.mark.parametrize("dtype", sorted(NARROW))
def test_narrow_rowwise_adagrad_is_the_float32_kernel_rounded(dtype: str) -> None:
    opt = ps.RowWiseAdagrad(lr=0.05)
    tables = _tables(opt, dtype)
    ec = EmbeddingCollection(tables)
    store = _store(tables)
    assert ec.local is not None
    # The replay: float32 copies of the rows, the float32 C kernel, round_to.
    wide = {t.name: ec.rows(t.name, torch.arange(t.num_rows or 0)) for t in tables}
    state = {t.name: ec.local.state(t.name, torch.arange(t.num_rows or 0)) for t in tables}
    clocks = {t.name: torch.zeros(t.num_rows or 0, dtype=torch.int64) for t in tables}
    gen = torch.Generator().manual_seed(2)
    for _ in range(STEPS):
        step = _distinct_step(gen, tables)
        _loss(ec(step.kjt), step.targets).backward()
        for t in tables:
            ids, grads = step.pushes[t.name]
            if ids.numel():
                store.push(t.name, ids, grads)
            srt, order = torch.sort(ids)
            w, c = wide[t.name], clocks[t.name]
            assert rowwise_adagrad.rowwise_adagrad_(
                w, state[t.name], c, srt, grads[order].contiguous(), lr=opt.lr, eps=opt.eps
            )
            seed = ec.local.specs[t.name].init.seed  # type: ignore[union-attr]
            w[srt] = round_to(w[srt], NARROW[dtype], seed=seed, ids=srt, versions=c[srt]).float()
    for t in tables:
        ids = torch.arange(t.num_rows or 0)
        got = ec.rows(t.name, ids)
        assert_same(
            got,
            wide[t.name],
            what=f"{t.name} rows vs the float32 kernel rounded",
            why="the narrow pass runs the float32 kernel's step, then round_to's bits",
        )
        assert_same(ec.local.state(t.name, ids), state[t.name], what="state", why="one kernel")
        assert torch.equal(ec.clocks(t.name, ids), clocks[t.name])
        # Against the store (torch apply): the float32 results differ by an ulp at times,
        # which moves a rounding by at most one step of the type; the steps add up.
        want = store.pull(t.name, ids).rows
        scale = torch.maximum(got.abs(), want.abs()).amax(1, keepdim=True)  # [R, 1]
        assert bool(((got - want).abs() <= STEPS * STEP[dtype] * scale).all())


@pytest.mark.parametrize("dtype", sorted(NARROW))
def test_groups_split_by_dtype_and_fp32_tables_are_unchanged(dtype: str) -> None:
    opt = ps.RowWiseAdagrad(lr=0.05)
    wide = TableConfig(name="w", num_rows=40, dim=8, feature_names=["w"], optimizer=opt)
    narrow = dataclasses.replace(wide, name="n", feature_names=["n"], dtype=dtype)
    mixed = EmbeddingCollection([wide, narrow])
    alone = EmbeddingCollection([wide])
    assert mixed.local is not None
    assert sorted(str(g.weight.dtype) for g in mixed.local.groups) == sorted(
        [str(torch.float32), str(NARROW[dtype])]
    )
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        step = _distinct_step(gen, [wide, narrow])
        _loss(mixed(step.kjt), step.targets).backward()
        only = {"w": step.kjt.key_slice("w")}
        out = alone(KeyedJaggedIds.from_lists({"w": _as_lists(only["w"])}))
        _loss(out, {"w": step.targets["w"]}).backward()
    ids = torch.arange(40)
    assert_same(
        mixed.rows("w", ids),
        alone.rows("w", ids),
        what="fp32 table",
        why="the float32 group runs alone in both collections",
    )
    rows = mixed.rows("n", ids)
    assert rows.dtype == torch.float32
    assert torch.equal(rows, rows.to(NARROW[dtype]).float()), "narrow values, read widened"


def _as_lists(kjt: KeyedJaggedIds) -> list[list[int]]:
    offsets = kjt.offsets().tolist()
    ids = kjt.ids.tolist()
    return [ids[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]


@pytest.mark.parametrize("dtype", sorted(NARROW))
def test_unpooled_mean_and_weighted_lookups_pool_in_float32(dtype: str) -> None:
    tok = TableConfig(
        name="tok", num_rows=20, dim=4, feature_names=["seq"], pooling="none", dtype=dtype
    )  # type: ignore[arg-type]
    bag = TableConfig(
        name="bag", num_rows=20, dim=4, feature_names=["x"], pooling="mean", dtype=dtype
    )  # type: ignore[arg-type]
    ec = EmbeddingCollection([tok, bag]).eval()
    w_tok, w_bag = ec.rows("tok", torch.arange(20)), ec.rows("bag", torch.arange(20))
    seq = [[1, 2, 3], [4, 4, 0], [5, 6, 7]]
    bags = [[1, 1, 1, 2], [], [19]]
    out = ec(KeyedJaggedIds.from_lists({"seq": seq, "x": bags}))
    assert_same(
        out["seq"],
        w_tok[torch.tensor(seq)],
        what="unpooled",
        why="a bag of one id with weight 1 is its row widened, exactly",
    )
    want = torch.stack([w_bag[torch.tensor(b)].mean(0) if b else torch.zeros(4) for b in bags])
    assert out["x"].dtype == torch.float32
    assert_close(
        out["x"],
        want,
        atol=sum_tol(torch.float32, 5, float(w_bag.abs().max()) * 4),
        what="mean bags",
        why="one float32 sum of 4 terms and a scaling, two orders",
    )
    # Per-id weights, against nn.EmbeddingBag on the widened rows.
    summed = dataclasses.replace(bag, name="s", feature_names=["s"], pooling="sum")
    weighted = EmbeddingCollection([summed]).eval()
    ref = torch.nn.EmbeddingBag.from_pretrained(weighted.rows("s", torch.arange(20)), mode="sum")
    lists = [[3, 3, 9], [], [0, 19, 4, 4]]
    w = [[0.5, 1.5, -2.0], [], [1.0, 0.25, 3.0, -1.0]]
    got = weighted(KeyedJaggedIds.from_lists({"s": lists}, weights={"s": w}))["s"]
    ids = torch.tensor([i for b in lists for i in b])
    offsets = torch.tensor([0, 3, 3])
    want = ref(ids, offsets, per_sample_weights=torch.tensor([x for b in w for x in b]))
    assert got.dtype == torch.float32
    assert_close(
        got,
        want,
        atol=sum_tol(torch.float32, 8, 8.0 * float(ref.weight.abs().max())),
        what="weighted bags",
        why="4 products and sums in two orders (fused or not)",
    )


@pytest.mark.parametrize("dtype", sorted(NARROW))
def test_checkpoint_keeps_dtype_and_bits(dtype: str, tmp_path: Path) -> None:
    tables = _tables(ps.Adam(lr=0.01), dtype)
    ec = EmbeddingCollection(tables)
    gen = torch.Generator().manual_seed(4)
    for _ in range(2):
        step = _distinct_step(gen, tables)
        _loss(ec(step.kjt), step.targets).backward()
    ec.save(tmp_path / "ckpt")
    again = EmbeddingCollection(tables)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same dtype: no conversion notice
        again.load(tmp_path / "ckpt")
    store = ps.InProcessStore()
    store.load(tmp_path / "ckpt")  # the ps format: a store reads it, dtype included
    nxt = _distinct_step(gen, tables)
    for coll in (ec, again):
        _loss(coll(nxt.kjt), nxt.targets).backward()
    for t in tables:
        ids = torch.arange(t.num_rows or 0)
        assert store.spec(t.name).dtype == dtype
        assert_same(
            again.rows(t.name, ids),
            ec.rows(t.name, ids),
            what=f"{t.name} resumed",
            why="the same rows, state and clocks: the next update rounds alike",
        )
    # State dict: rows in their stored type, round trip exact.
    sd = ec.state_dict()
    assert sd["local.a.weight"].dtype == NARROW[dtype]
    third = EmbeddingCollection(tables)
    third.load_state_dict(sd)
    assert_same(
        third.rows("a", torch.arange(48)),
        ec.rows("a", torch.arange(48)),
        what="state dict round trip",
        why="copied in the stored type",
    )


@pytest.mark.parametrize("dtype", sorted(NARROW))
def test_loading_another_dtype_converts_and_says_so_once(dtype: str, tmp_path: Path) -> None:
    wide_tables = _tables(ps.Adam(lr=0.01), "fp32")
    wide = EmbeddingCollection(wide_tables)
    step = _distinct_step(torch.Generator().manual_seed(5), wide_tables)
    _loss(wide(step.kjt), step.targets).backward()
    wide.save(tmp_path / "wide")
    narrow = EmbeddingCollection(_tables(ps.Adam(lr=0.01), dtype))
    with pytest.warns(UserWarning) as record:
        narrow.load(tmp_path / "wide")
    notes = [str(w.message) for w in record if "converted" in str(w.message)]
    assert len(notes) == 1, notes
    assert "'a' (fp32 -> " in notes[0] and "'b' (fp32 -> " in notes[0]
    for name, n in (("a", 48), ("b", 30)):
        ids = torch.arange(n)
        nearest = wide.rows(name, ids).to(NARROW[dtype]).float()
        assert_same(
            narrow.rows(name, ids),
            nearest,
            what=f"{name} converted",
            why="float32 rows rounded to the nearest by one conversion",
        )
        assert torch.equal(narrow.clocks(name, ids), wide.clocks(name, ids))
    with pytest.warns(UserWarning, match=r"state dict .*'a' \(fp32 -> "):
        narrow.load_state_dict(wide.state_dict())
    # And back: narrow rows widen exactly into float32 tables.
    narrow.save(tmp_path / "narrow")
    back = EmbeddingCollection(wide_tables)
    with pytest.warns(UserWarning, match=r"-> fp32\)"):
        back.load(tmp_path / "narrow")
    assert_same(
        back.rows("a", torch.arange(48)),
        narrow.rows("a", torch.arange(48)),
        what="widened",
        why="a narrow value is a float32 value",
    )


def test_dtypes_are_checked_and_kept() -> None:
    with pytest.raises(
        ValueError,
        match=r"table 't': dtype must be one of fp32, fp16, bf16, "
        r"got 'fp8'",
    ):
        TableConfig(name="t", num_rows=5, dim=2, feature_names=["x"], dtype="fp8")  # type: ignore[arg-type]
    cfg = TableConfig(name="t", num_rows=5, dim=2, feature_names=["x"], dtype="bf16")
    ec = EmbeddingCollection([cfg])
    ec.half()  # a module cast leaves the tables' types alone
    assert ec.local is not None
    assert ec.local.groups[0].weight.dtype == torch.bfloat16
    assert ec.local.groups[0].state.dtype == torch.float32
    with pytest.raises(ValueError, match="RoundingKeys: dtype must be torch.float16 or "):
        narrow_rows.RoundingKeys.of_tables(torch.float32, [5], [1])
    # A narrow group without its keys would update in the narrow type: refused.
    w, s, c = torch.zeros(5, 2, dtype=torch.float16), torch.zeros(5, 1), torch.zeros(5).long()
    with pytest.raises(ValueError, match="torch.float16 weight needs the RoundingKeys"):
        FusedGroup(2, cfg.optimizer, w, s, c)
    keys = narrow_rows.RoundingKeys.of_tables(torch.bfloat16, [5], [1])
    with pytest.raises(ValueError, match="keys of torch.bfloat16 for a torch.float16 weight"):
        FusedGroup(2, cfg.optimizer, w, s, c, keys)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("nprocs", [1, 2, 4])
def test_data_parallel_narrow_tables_equal_one_process(nprocs: int) -> None:
    """tests/embedding/ranks/local_narrow_dp.py: replicas trained on slices of a batch
    (gradients exchanged, divided by the ranks) against one process on the whole batch."""
    outputs = run_ranks("local_narrow_dp.py", nprocs, "gloo", timeout=180)
    text = "\n".join(outputs)
    for rank in range(nprocs):
        assert f"rank {rank}/{nprocs}: ok narrow local data parallel" in text, text


@pytest.mark.gpu
@pytest.mark.parametrize("opt_name", ["rowwise_adagrad", "adam"])
@pytest.mark.parametrize("dtype", sorted(NARROW))
def test_cuda_narrow_tables_follow_the_cpu_ones(dtype: str, opt_name: str) -> None:
    """The same steps on CUDA (Triton kernels where they build, else the torch path) and
    on the host: the float32 updates may differ by an ulp (another order of operations,
    contracted or not), which moves a stochastic rounding by at most one step of the
    type; the steps add up. Clocks are equal."""
    tables = _tables(OPTIMIZERS[opt_name], dtype)
    cpu, cuda = EmbeddingCollection(tables), EmbeddingCollection(tables, device="cuda")
    gen = torch.Generator().manual_seed(6)
    for _ in range(STEPS):
        step = _distinct_step(gen, tables)
        _loss(cpu(step.kjt), step.targets).backward()
        out = cuda(step.kjt.to("cuda"))
        assert all(o.dtype == torch.float32 for o in out.values())
        targets = {f: t.to("cuda") for f, t in step.targets.items()}
        _loss(out, targets).backward()
    for t in tables:
        ids = torch.arange(t.num_rows or 0)
        got, want = cuda.rows(t.name, ids.cuda()).cpu(), cpu.rows(t.name, ids)
        scale = torch.maximum(got.abs(), want.abs()).amax(1, keepdim=True)  # [R, 1]
        assert bool(((got - want).abs() <= STEPS * STEP[dtype] * scale).all()), t.name
        assert torch.equal(cuda.clocks(t.name, ids.cuda()).cpu(), cpu.clocks(t.name, ids))
