"""The C passes over fp16/bf16 rows (ps/kernels/narrow_rows.c) against their definitions.

* :func:`narrow_rows.round_rows` against :func:`ps.rounding.round_to` (per table, with each
  row's seed and id), bit for bit, over values of every magnitude and the special ones;
* the row-wise Adagrad passes against the float32 kernel (ps/kernels/rowwise_adagrad.c)
  on the rows widened, followed by ``round_to`` of the touched rows, bit for bit: the
  narrow pass runs that kernel's step on the widened row;
* the pooling against plain torch summing the widened rows in the same order (separate
  multiply and add: the kernel contracts nothing), bit for bit, and the widening of every
  fp16 and bf16 bit pattern;
* the same bits from a build for the baseline x86-64 (SSE2 only) as from the
  ``-march=native`` build the loader prefers: no result depends on the CPU's extensions.
"""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import pytest
import torch

from comm import native
from ps.kernels import narrow_rows, rowwise_adagrad
from ps.kernels.narrow_rows import RoundingKeys
from ps.rounding import round_to
from tolerance import assert_same

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not narrow_rows.available(), reason="no C compiler: torch path only"),
]

NARROW = {"fp16": torch.float16, "bf16": torch.bfloat16}
SIZES, SEEDS = [100, 250, 150], [7, 2**63 - 1, 12345]
KERNEL_THEN_ROUND = (
    "the narrow pass is the float32 kernel's step on the widened row, then round_to's bits"
)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def _values(gen: torch.Generator, n: int, d: int) -> torch.Tensor:
    """Values from 1e-10 to 1e6 in magnitude, both signs, and the special ones."""
    x = torch.randn(n, d, generator=gen) * torch.logspace(-10, 6, n)[:, None]
    x[0, :6] = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 70000.0, -65519.0])
    x[1, :6] = torch.tensor([2.0**-14, -(2.0**-15), 2.0**-24, 3e-8, 3.4e38, -1e-40])
    return x


def _reference_round(
    x: torch.Tensor,
    dtype: torch.dtype,
    rows: torch.Tensor,
    versions: torch.Tensor,
    row_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    keys = RoundingKeys.of_tables(dtype, SIZES, SEEDS)
    tables = keys.tables_of(rows)
    ids = rows - keys.starts[tables] if row_ids is None else row_ids[rows]
    out = torch.empty(x.shape, dtype=dtype)
    for k, seed in enumerate(SEEDS):
        sel = tables == k
        out[sel] = round_to(x[sel], dtype, seed=seed, ids=ids[sel], versions=versions[sel])
    return out


# 37: one chunk of the C pass's draws, the last group of four columns partial; 131: three
# chunks of 64 columns (draws made 64 at a time), the last one partial
@pytest.mark.parametrize("d", [37, 131])
@pytest.mark.parametrize("with_row_ids", [False, True], ids=["bases", "row_ids"])
@pytest.mark.parametrize("dtype", sorted(NARROW))
def test_round_rows_is_round_to(dtype: str, with_row_ids: bool, d: int) -> None:
    dt = NARROW[dtype]
    gen = torch.Generator().manual_seed(0)
    n = 3000
    x = _values(gen, n, d)
    rows = torch.randint(0, sum(SIZES), (n,), generator=gen)
    versions = torch.randint(0, 10**9, (n,), generator=gen)
    row_ids = torch.randint(0, 2**40, (sum(SIZES),), generator=gen) if with_row_ids else None
    keys = RoundingKeys.of_tables(dt, SIZES, SEEDS)
    if row_ids is not None:
        keys = RoundingKeys(dt, keys.starts, keys.seeds, row_ids)
    got = narrow_rows.round_rows(x, keys, rows, versions)
    want = _reference_round(x, dt, rows, versions, row_ids)
    assert_same(
        _bits(got),
        _bits(want),
        what=f"{dtype} rounding",
        why="one hash on uint64 and the same float32 steps as round_to",
    )
    nan = torch.full((2, d), float("nan"))
    assert bool(narrow_rows.round_rows(nan, keys, rows[:2], versions[:2]).isnan().all())


@pytest.mark.parametrize("dtype", sorted(NARROW))
def test_round_rows_is_round_to_on_every_kind_of_bit_pattern(dtype: str) -> None:
    """A stride through all 2**32 float32 bit patterns (both signs, every exponent:
    subnormals, fp16's subnormal and overflow ranges, Inf, NaNs with payloads), each
    rounded with varied bits: the branch-free C rounding against round_to's. A NaN must
    stay a NaN (torch's conversion keeps a NaN's payload bits, the C pass writes the quiet
    NaN of ``test_round_rows_is_round_to``)."""
    dt = NARROW[dtype]
    patterns = torch.arange(0, 2**32, 4099, dtype=torch.int64)
    x = (patterns - 2**32 * (patterns >= 2**31)).to(torch.int32).view(torch.float32)
    x = x[: x.numel() // 64 * 64].reshape(-1, 64)  # [n, 64]
    n = x.shape[0]
    rows = torch.arange(n) % sum(SIZES)
    versions = torch.arange(n, dtype=torch.int64) * 7919
    keys = RoundingKeys.of_tables(dt, SIZES, SEEDS)
    got = narrow_rows.round_rows(x, keys, rows, versions)
    want = _reference_round(x, dt, rows, versions, None)
    nan = x.isnan()
    assert bool(got[nan].isnan().all())
    assert_same(
        _bits(got[~nan]),
        _bits(want[~nan]),
        what=f"{dtype} rounding of bit patterns",
        why="one hash on uint64 and the same float32 steps as round_to",
    )


def test_round_rows_falls_back_to_round_to(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(1)
    x = _values(gen, 500, 9)
    rows = torch.randint(0, sum(SIZES), (500,), generator=gen)
    versions = torch.randint(0, 100, (500,), generator=gen)
    keys = RoundingKeys.of_tables(torch.float16, SIZES, SEEDS)
    with_c = narrow_rows.round_rows(x, keys, rows, versions)
    monkeypatch.setenv("HYBRIDREC_CPU_KERNEL", "0")
    assert not narrow_rows.available()
    assert_same(
        _bits(narrow_rows.round_rows(x, keys, rows, versions)),
        _bits(with_c),
        what="torch path",
        why="round_to per table",
    )


def _adagrad_problem(seed: int, n: int, d: int, dtype: torch.dtype) -> dict:
    gen = torch.Generator().manual_seed(seed)
    rows = sum(SIZES)
    hot = torch.randint(0, 40, (n,), generator=gen)  # long runs of a few rows
    ids = torch.where(
        torch.rand(n, generator=gen) < 0.5, hot, torch.randint(0, rows, (n,), generator=gen)
    )
    nbags = max(1, n // 3)
    return {
        "weight": (torch.randn(rows, d, generator=gen) * 0.3).to(dtype),
        "state": torch.rand(rows, 1, generator=gen),
        "ids": ids,
        "bag_of": torch.randint(0, nbags, (n,), generator=gen),
        "grad": torch.randn(nbags, d, generator=gen),
        "weights": torch.rand(n, generator=gen) + 0.5,
    }


@pytest.mark.parametrize(("n", "threads"), [(0, 1), (300, 1), (9000, 2)])
@pytest.mark.parametrize("dtype", sorted(NARROW))
def test_narrow_adagrad_is_the_float32_kernel_rounded(dtype: str, n: int, threads: int) -> None:
    dt = NARROW[dtype]
    p = _adagrad_problem(n, n, 24, dt)
    keys = RoundingKeys.of_tables(dt, SIZES, SEEDS)
    srt, perm = torch.sort(p["ids"])
    lr, eps = 0.05, 1e-6
    weight, state = p["weight"].clone(), p["state"].clone()
    clocks = torch.randint(0, 5, (sum(SIZES),))
    wide, wstate, wclocks = p["weight"].float(), p["state"].clone(), clocks.clone()
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert narrow_rows.rowwise_adagrad_(
            weight,
            state,
            clocks,
            srt,
            p["grad"],
            lr=lr,
            eps=eps,
            keys=keys,
            perm=perm,
            bag_of=p["bag_of"],
            weights=p["weights"],
        )
        assert rowwise_adagrad.rowwise_adagrad_(
            wide,
            wstate,
            wclocks,
            srt,
            p["grad"],
            lr=lr,
            eps=eps,
            perm=perm,
            bag_of=p["bag_of"],
            weights=p["weights"],
        )
    finally:
        torch.set_num_threads(old)
    touched = torch.unique(p["ids"])
    want = wide.to(dt)  # untouched rows: narrow values, exact
    want[touched] = narrow_rows.round_rows(wide[touched], keys, touched, wclocks[touched])
    assert_same(_bits(weight), _bits(want), what="rows", why=KERNEL_THEN_ROUND)
    assert_same(state, wstate, what="state", why="the float32 kernel's accumulator step")
    assert torch.equal(clocks, wclocks)


@pytest.mark.parametrize("dtype", sorted(NARROW))
def test_narrow_parts_pass_equals_the_concatenated_one(dtype: str) -> None:
    dt = NARROW[dtype]
    gen = torch.Generator().manual_seed(3)
    rows, d, b = sum(SIZES), 16, 2500
    lengths = torch.randint(0, 3, (3 * b,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    n = int(offsets[-1])
    ids = torch.randint(0, rows, (n,), generator=gen)
    block = torch.randn(b, 4, d, generator=gen)
    parts = [block[:, 1], torch.randn(1, d, generator=gen).expand(b, d), block[:, 3]]
    whole = torch.cat(parts).contiguous()
    bag_of = torch.repeat_interleave(torch.arange(3 * b), lengths)
    srt, perm = torch.sort(ids)
    keys = RoundingKeys.of_tables(dt, SIZES, SEEDS)
    start = (torch.randn(rows, d, generator=gen).to(dt), torch.rand(rows, 1, generator=gen))
    got = [t.clone() for t in start] + [torch.zeros(rows, dtype=torch.int64)]
    want = [t.clone() for t in start] + [torch.zeros(rows, dtype=torch.int64)]
    assert narrow_rows.rowwise_adagrad_parts_(
        *got, srt, perm, offsets, parts, lr=0.05, eps=1e-6, keys=keys
    )
    assert narrow_rows.rowwise_adagrad_(
        *want, srt, whole, lr=0.05, eps=1e-6, keys=keys, perm=perm, bag_of=bag_of
    )
    same = "one pass, only where each bag's gradient row is read from differs"
    assert_same(_bits(got[0]), _bits(want[0]), what="rows", why=same)
    assert_same(got[1], want[1], what="state", why=same)
    assert torch.equal(got[2], want[2])


def _pool_reference(
    weight: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor, w: torch.Tensor | None
) -> torch.Tensor:
    """Bag sums of the widened rows, one position of every bag at a time, in id order:
    ``acc = acc + w_i * row_i`` with the product and the sum rounded separately."""
    rows = weight.float()[ids]  # [N, D]
    lengths = offsets[1:] - offsets[:-1]
    acc = torch.zeros(lengths.numel(), weight.shape[1])
    for k in range(int(lengths.max()) if lengths.numel() else 0):
        live = torch.nonzero(lengths > k).squeeze(1)
        term = rows[offsets[live] + k]
        if w is not None:
            term = term * w[offsets[live] + k][:, None]
        acc[live] = acc[live] + term
    return acc


# 19: one chunk of widened columns with a tail past the last 8; 150: three chunks of 64
@pytest.mark.parametrize("d", [19, 150])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype", sorted(NARROW))
def test_pool_sums_widened_rows_in_float32(dtype: str, weighted: bool, d: int) -> None:
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(500, d, generator=gen).to(NARROW[dtype])
    lengths = torch.randint(0, 6, (4000,), generator=gen)  # empty bags too; > 4096 ids
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    ids = torch.randint(0, 500, (int(offsets[-1]),), generator=gen)
    w = torch.rand(ids.numel(), generator=gen) * 2 - 0.5 if weighted else None
    out = narrow_rows.pool(weight, ids, offsets, w)
    assert out is not None and out.dtype == torch.float32
    assert_same(
        out,
        _pool_reference(weight, ids, offsets, w),
        what="pooled",
        why="the same products and sums in the same order, none fused",
    )


@pytest.mark.parametrize("dtype", sorted(NARROW))
def test_every_bit_pattern_widens_exactly(dtype: str) -> None:
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    weight = every.view(NARROW[dtype]).reshape(-1, 64).contiguous()  # [1024, 64]
    n = weight.shape[0]
    got = narrow_rows.pool(weight, torch.arange(n), torch.arange(n + 1))
    assert got is not None
    want = weight.float()
    # A bag of one row is 0 + row: -0 pools to +0, as in any sum; NaN stays NaN.
    same = (got == want) | (got.isnan() & want.isnan())
    assert bool(same.all()), f"{int((~same).sum())} values widened wrongly"


def test_passes_refuse_what_they_cannot_handle() -> None:
    keys = RoundingKeys.of_tables(torch.float16, [4], [1])
    w = torch.zeros(4, 3, dtype=torch.float16)
    s, c, ids, g = (
        torch.zeros(4, 1),
        torch.zeros(4, dtype=torch.int64),
        torch.tensor([1]),
        torch.ones(1, 3),
    )
    assert not narrow_rows.rowwise_adagrad_(w.float(), s, c, ids, g, lr=1, eps=1, keys=keys)
    assert not narrow_rows.rowwise_adagrad_(w.bfloat16(), s, c, ids, g, lr=1, eps=1, keys=keys)
    assert not narrow_rows.rowwise_adagrad_(
        w.t().contiguous().t(), s, c, ids, g, lr=1, eps=1, keys=keys
    )
    assert not narrow_rows.rowwise_adagrad_(w, s, c, ids.int(), g, lr=1, eps=1, keys=keys)
    assert bool((w == 0).all()), "a refused call wrote rows"
    assert narrow_rows.pool(w.float(), ids, torch.tensor([0, 1])) is None
    with pytest.raises(ValueError, match="starts must have one entry more than seeds"):
        RoundingKeys(torch.float16, torch.tensor([0, 4]), torch.tensor([1, 2]))
    with pytest.raises(TypeError, match="seeds must be 1-D int64"):
        RoundingKeys(torch.float16, torch.tensor([0, 4]), torch.tensor([1.0]))


# ------------------------------------------------------------ the same bits on every CPU

_BUILDS = {"native": ("-O3", "-march=native", "-fopenmp"), "x86-64": ("-O3", "-march=x86-64")}


def _build(flags: tuple[str, ...], out: Path) -> ctypes.CDLL:
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc is not None
    source = rowwise_adagrad._SOURCE + "\n" + narrow_rows._SOURCE
    assert native._compile(cc, flags, source, out), f"the build with {flags} failed"
    lib = ctypes.CDLL(str(out))
    narrow_rows._declare(lib)
    return lib


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no cc")
@pytest.mark.parametrize("dtype", sorted(NARROW))
def test_builds_for_any_cpu_give_the_same_bits(dtype: str, tmp_path: Path) -> None:
    dt = NARROW[dtype]
    results = {}
    for name, flags in _BUILDS.items():
        lib = _build(flags, tmp_path / f"{name}.so")
        p = _adagrad_problem(7, 6000, 40, dt)
        keys = RoundingKeys.of_tables(dt, SIZES, SEEDS)
        srt, perm = torch.sort(p["ids"])
        weight, state = p["weight"].clone(), p["state"].clone()
        clocks = torch.zeros(sum(SIZES), dtype=torch.int64)
        ptr = narrow_rows._ptr
        lib.hr_narrow_adagrad(
            srt.numel(),
            40,
            1,
            ptr(srt),
            ptr(perm),
            ptr(p["bag_of"]),
            ptr(p["weights"]),
            ptr(p["grad"]),
            ptr(weight),
            ptr(state),
            ptr(clocks),
            0.05,
            1e-6,
            *keys._args(),
            2,
        )
        pooled = torch.empty(srt.numel() // 4, 40)
        offsets = torch.arange(0, srt.numel() + 1, 4)[: pooled.shape[0] + 1].contiguous()
        lib.hr_narrow_pool(
            pooled.shape[0],
            40,
            narrow_rows.DTYPE_CODES[dt],
            ptr(p["ids"]),
            ptr(offsets),
            ptr(p["weights"]),
            ptr(weight),
            ptr(pooled),
            2,
        )
        results[name] = (weight, state, pooled)
    a, b = results["native"], results["x86-64"]
    why = "integer hashing, exact conversions and IEEE float32 steps with nothing contracted"
    assert_same(_bits(a[0]), _bits(b[0]), what="rows", why=why)
    assert_same(a[1], b[1], what="state", why=why)
    assert_same(a[2], b[2], what="pooled", why=why)
