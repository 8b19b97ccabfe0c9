"""Tables of fp16 and bf16 rows in the in-process store (``TableSpec(dtype=...)``).

The reference replays the definition with plain torch: the initial rows rounded to the
narrow type, then per push the summed gradient of each row applied by the optimizer's
own ``apply`` to the widened row and its float32 state, and the result stochastically
rounded by :func:`ps.rounding.round_to` (its rounding is tested against the
definition in ``test_rounding.py``) keyed by the row's id and its clock after the
update. Row-wise Adagrad on a fixed table is the store's C pass (the float32 kernel's
step, which rounds its mean of squares differently from the torch step, then the
rounding), so there the replay's step is that float32 kernel's on the widened row. The
store runs the same float32 operations in the same order on the same values, so the
rows are compared bit for bit. A narrow table also stays within a few
steps of the narrow type of the float32 table (each update rounds once, by less than
one step, and stochastic rounding does not drift).
"""

from __future__ import annotations

import pytest
import torch

import cache
import ps
from ps.kernels import narrow_rows, rowwise_adagrad
from ps.rounding import round_to

pytestmark = [pytest.mark.timeout(120), pytest.mark.numerics]

DIM = 8
ROWS = 50
NARROW = {"fp16": torch.float16, "bf16": torch.bfloat16}
OPTIMIZERS = {
    "sgd": ps.SGD(lr=0.05),
    "sgd_momentum": ps.SGD(lr=0.05, momentum=0.9),
    "rowwise_adagrad": ps.RowWiseAdagrad(lr=0.05),
    "adagrad": ps.Adagrad(lr=0.05),
    "adam": ps.Adam(lr=0.01),
    "ftrl": ps.FTRL(alpha=0.1, l1=0.001, l2=0.001),
}


def _spec(name: str, opt: ps.Optimizer, dtype: str, dynamic: bool = False) -> ps.TableSpec:
    return ps.TableSpec(
        name=name, num_rows=None if dynamic else ROWS, dim=DIM, optimizer=opt, dtype=dtype
    )


def _pushes(steps: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, ROWS, (24,), generator=g)  # repeats: summed by the store
        out.append((ids, torch.randn(24, DIM, generator=g) * 0.3))
    return out


class _Replay:
    """The definition, row by row in plain torch (see the module docstring)."""

    def __init__(self, spec: ps.TableSpec) -> None:
        self.spec = spec
        opt = spec.optimizer
        self.c_step = (
            isinstance(opt, ps.RowWiseAdagrad) and not spec.dynamic and narrow_rows.available()
        )
        self.rows: dict[int, torch.Tensor] = {}  # id -> narrow [D]
        self.state: dict[int, torch.Tensor] = {}
        self.clock: dict[int, int] = {}

    def _row(self, i: int) -> torch.Tensor:
        if i not in self.rows:
            init = self.spec.initial_rows(torch.tensor([i]))[0]
            self.rows[i] = init.to(self.spec.torch_dtype)  # stored: rounded to nearest
            self.state[i] = self.spec.initial_state().clone()
            self.clock[i] = 0
        return self.rows[i]

    def push(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        uniq, inv = torch.unique(ids, return_inverse=True)
        summed = torch.zeros(uniq.numel(), DIM).index_add_(0, inv, grads)
        for k, i in enumerate(uniq.tolist()):
            row = self._row(i).to(torch.float32)[None, :].clone()
            state = self.state[i][None, :].clone()
            if self.c_step:  # the float32 C kernel on a one-row table
                opt = self.spec.optimizer
                assert isinstance(opt, ps.RowWiseAdagrad)
                zero = torch.zeros(1, dtype=torch.int64)  # the row's index and a spare clock
                assert rowwise_adagrad.rowwise_adagrad_(
                    row, state, zero.clone(), zero, summed[k : k + 1].contiguous(),
                    lr=opt.lr, eps=opt.eps,
                )  # fmt: skip
            else:
                self.spec.optimizer.apply(row, state, summed[k : k + 1])
            self.clock[i] += 1
            assert self.spec.init is not None
            self.rows[i] = round_to(
                row, self.spec.torch_dtype, seed=self.spec.init.seed,
                ids=torch.tensor([i]), versions=torch.tensor([self.clock[i]]),
            )[0]  # fmt: skip
            self.state[i] = state[0]

    def pull(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.stack([self._row(i).to(torch.float32) for i in ids.tolist()])


@pytest.mark.parametrize("dynamic", [False, True], ids=["fixed", "dynamic"])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("dtype", sorted(NARROW))
def test_narrow_rows_are_the_float32_update_stochastically_rounded(
    dtype: str, opt_name: str, dynamic: bool
) -> None:
    spec = _spec("t", OPTIMIZERS[opt_name], dtype, dynamic)
    store = ps.InProcessStore()
    store.create_table(spec)
    ref = _Replay(store.spec("t"))
    for step, (ids, grads) in enumerate(_pushes(6)):
        if step % 2:  # the batched path and the single one
            store.push_many([ps.PushRequest("t", ids, grads)])
        else:
            store.push("t", ids, grads)
        ref.push(ids, grads)
    every = torch.arange(ROWS)
    got = store.pull("t", every)
    assert got.rows.dtype == torch.float32
    assert torch.equal(got.rows, ref.pull(every)), "rows differ from the replay"
    (many,) = store.pull_many([ps.PullRequest("t", every)])
    assert torch.equal(many.rows, got.rows)


@pytest.mark.parametrize("dtype", sorted(NARROW))
def test_a_narrow_table_follows_the_float32_table_within_a_few_steps_of_its_type(
    dtype: str,
) -> None:
    narrow_store, wide_store = ps.InProcessStore(), ps.InProcessStore()
    opt = ps.RowWiseAdagrad(lr=0.02)
    narrow_store.create_table(_spec("t", opt, dtype))  # one name: the same initial rows
    wide_store.create_table(_spec("t", opt, "fp32"))
    for ids, grads in _pushes(20, seed=1):
        narrow_store.push("t", ids, grads)
        wide_store.push("t", ids, grads)
    every = torch.arange(ROWS)
    narrow, wide = narrow_store.pull("t", every).rows, wide_store.pull("t", every).rows
    # One step of the type at a row's magnitude (2**-10 relative for fp16, 2**-7 for
    # bf16; the row's largest element bounds what its elements passed through, the
    # rows being of one scale); 20 updates of independent unbiased roundings move an
    # element by about sqrt(20) steps, 6 sqrt(20) is far outside chance.
    scale = torch.maximum(wide.abs(), narrow.abs()).amax(1, keepdim=True)  # [R, 1]
    step = {"fp16": 2.0**-10, "bf16": 2.0**-7}[dtype] * scale
    assert bool(((narrow - wide).abs() <= 6 * 20**0.5 * step).all())
    assert not torch.equal(narrow, wide)


@pytest.mark.parametrize("dtype", sorted(NARROW))
def test_counted_pushes_round_like_plain_ones(dtype: str) -> None:
    """A counted row-wise Adagrad push on narrow rows: the optimizer's counted
    sub-steps on the widened row, rounded once (the C pass, which is float32 only,
    leaves narrow tables to this path)."""
    spec = _spec("t", ps.RowWiseAdagrad(lr=0.05), dtype)
    store = ps.InProcessStore()
    store.create_table(spec)
    ids = torch.tensor([1, 4, 9])
    grads = torch.full((3, DIM), 0.25)
    counts = torch.tensor([1, 2, 4])
    stats = (grads * grads).mean(1, keepdim=True) * counts[:, None] / counts[:, None] ** 2
    store.push_many([ps.PushRequest("t", ids, grads, counts=counts, stats=stats)])
    spec = store.spec("t")
    assert spec.init is not None
    rows = spec.initial_rows(ids).to(spec.torch_dtype).to(torch.float32)
    state = spec.initial_state().repeat(3, 1)
    spec.optimizer.apply_counted(rows, state, grads, counts, stats)
    want = round_to(rows, spec.torch_dtype, seed=spec.init.seed, ids=ids, versions=torch.ones(3))
    assert torch.equal(store.pull("t", ids).rows, want.to(torch.float32))


@pytest.mark.parametrize("dtype", sorted(NARROW))
def test_rows_take_half_the_bytes_and_state_stays_float32(dtype: str) -> None:
    store = ps.InProcessStore()
    store.create_table(_spec("n", ps.Adam(lr=0.01), dtype))
    store.create_table(_spec("w", ps.Adam(lr=0.01), "fp32"))
    engine_n = store._tables["n"]  # noqa: SLF001 (the storage is what is measured)
    engine_w = store._tables["w"]  # noqa: SLF001
    assert engine_n.weights.dtype == NARROW[dtype] and engine_n.state.dtype == torch.float32
    w_bytes = engine_n.weights.element_size() * engine_n.weights.numel()
    assert w_bytes * 2 == engine_w.weights.element_size() * engine_w.weights.numel()
    spec = store.spec("n")
    assert spec.row_bytes == 2 * DIM + 4 * spec.state_dim + 8
    assert store.stats()["n"]["bytes"] == ROWS * spec.row_bytes


@pytest.mark.parametrize("dtype", sorted(NARROW))
def test_a_checkpoint_keeps_the_dtype_and_the_bits(dtype: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    store = ps.InProcessStore()
    store.create_table(_spec("f", ps.Adam(lr=0.01), dtype))
    store.create_table(_spec("d", ps.SGD(lr=0.1), dtype, dynamic=True))
    for ids, grads in _pushes(3):
        store.push_many([ps.PushRequest("f", ids, grads), ps.PushRequest("d", ids, grads)])
    store.save(tmp_path / "ckpt")
    again = ps.InProcessStore()
    again.load(tmp_path / "ckpt")
    every = torch.arange(ROWS)
    for name in ("f", "d"):
        assert again.spec(name).dtype == dtype
        assert torch.equal(again.pull(name, every).rows, store.pull(name, every).rows)
    # The next update rounds as the uninterrupted store's does (same clocks, same bits).
    ids, grads = _pushes(1, seed=5)[0]
    store.push("f", ids, grads)
    again.push("f", ids, grads)
    assert torch.equal(again.pull("f", every).rows, store.pull("f", every).rows)


def test_specs_record_the_dtype_and_refuse_unknown_ones() -> None:
    wide = _spec("t", ps.SGD(lr=0.1), "fp32")
    assert "dtype" not in wide.to_json()  # an fp32 spec reads as before
    narrow = _spec("t", ps.SGD(lr=0.1), "bf16")
    assert ps.TableSpec.from_json(narrow.to_json()) == narrow
    with pytest.raises(ValueError, match=r"table 't': dtype must be one of fp32, fp16, bf16"):
        _spec("t", ps.SGD(lr=0.1), "int8")


@pytest.mark.parametrize("dtype", sorted(NARROW))
def test_a_cache_at_bounds_zero_serves_the_narrow_store_s_rows(dtype: str) -> None:
    """Bounds (0, 0): every update is pushed at once and every pushed row refreshed,
    so the cached store serves the uncached store's rows bit for bit."""
    plain, behind = ps.InProcessStore(), ps.InProcessStore()
    for s in (plain, behind):
        s.create_table(_spec("t", ps.RowWiseAdagrad(lr=0.05), dtype))
    cfg = cache.CacheConfig(capacity_fraction=0.3, read_bound=0, write_bound=0)
    cached = cache.CachedStore(behind, cfg)
    for ids, grads in _pushes(8, seed=3):
        a, b = plain.pull("t", ids), cached.pull("t", ids)
        assert torch.equal(a.rows, b.rows)
        plain.push("t", ids, grads)
        cached.push("t", ids, grads)
    cached.flush()
    every = torch.arange(ROWS)
    assert torch.equal(cached.pull("t", every).rows, plain.pull("t", every).rows)
