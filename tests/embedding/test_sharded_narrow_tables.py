"""Sharded tables of fp16 and bf16 rows (embedding.sharded.ShardedTables, TableConfig.dtype).

* Real processes (tests/embedding/ranks/embedding_sharded_narrow.py) at 1, 2 and 4 ranks,
  under mpirun and gloo: several training steps equal one in-process store holding the
  whole tables, bit for bit (tables, optimizer state, clocks), and the same tables placed
  "local" in one process (their rows), so every rank count and
  backend ends with the same bits (their digests are compared here); the rows come back
  in their stored type (2 bytes per element) and the gradients go in float32;
  checkpoints record the dtype, load exactly into another plan and into a store, and
  resume training exactly.
* In one process (a LocalGroup): the bytes the row exchange moves; SGD steps against
  plain torch followed by :func:`ps.rounding.round_to`; the device path's update, run on
  host tensors, against the host engine; checkpoint and state dict conversions; the
  plan's bytes per row; mixed-type byte buffers that start off alignment.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import comm
import ps
from embedding.config import TableConfig
from embedding.jagged import KeyedJaggedIds
from embedding.jagged_dist import pack_rows, widen_rows, wire_dtype, wire_widths
from embedding.sharded import ShardedTables
from embedding.sharding_plan import ShardingPlan
from multiproc import run_ranks
from ps.checkpoint import read_checkpoint
from ps.rounding import round_to
from ps.table import TORCH_ROW_DTYPES
from rank_battery import EMBEDDING_CASES
from tolerance import assert_same

pytestmark = pytest.mark.numerics  # rerun under each ATEN_CPU_CAPABILITY

SCRIPT = "embedding_sharded_narrow.py"
# A launch: ranks start (4 import torch on 2 shared cores), then three checks.
LAUNCH_TIMEOUT_S = 60 + 3 * 60
SCENARIOS = ("fp16", "bf16", "mixed")
NARROW = ["fp16", "bf16"]


class Launches:
    """Each (backend, ranks) launch of the rank script at most once per session."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self._outputs: dict[tuple[str, int], str] = {}

    def output(self, backend: str, nprocs: int) -> str:
        key = (backend, nprocs)
        if key not in self._outputs:
            ckpt = self.workdir / f"ckpt-{backend}-{nprocs}"
            ckpt.mkdir(parents=True, exist_ok=True)
            outs = run_ranks(SCRIPT, nprocs, backend, ["all", str(ckpt)], LAUNCH_TIMEOUT_S)
            self._outputs[key] = "\n".join(outs)
        return self._outputs[key]

    def digests(self, backend: str, nprocs: int) -> dict[str, set[str]]:
        """Per scenario, the digests of the final tables every rank printed."""
        text = self.output(backend, nprocs)
        out: dict[str, set[str]] = {}
        # 16 hex digits: mpirun may print another rank's line right after one
        found = re.findall(
            r"rank \d+/\d+ (\w+): ok narrow sharded training digest ([0-9a-f]{16})", text
        )
        for scenario, value in found:
            out.setdefault(scenario, set()).add(value)
        return out


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> Launches:
    return Launches(tmp_path_factory.mktemp("narrow_sharded"))


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize(("backend", "nprocs"), EMBEDDING_CASES)
def test_narrow_sharded_equals_one_process(backend: str, nprocs: int, launches: Launches) -> None:
    text = launches.output(backend, nprocs)
    lines = []
    for rank in range(nprocs):
        lines += [f"rank {rank}/{nprocs} {s}: ok narrow sharded training" for s in SCENARIOS]
        lines.append(f"rank {rank}/{nprocs}: ok narrow sharded wire ({backend})")
        lines.append(f"rank {rank}/{nprocs}: ok narrow sharded checkpoint ({backend})")
    missing = [line for line in lines if line not in text]
    assert not missing, f"missing from {backend} x{nprocs}: {missing}\n{text}"


@pytest.mark.timeout(len(EMBEDDING_CASES) * LAUNCH_TIMEOUT_S + 60)
def test_same_bits_at_every_rank_count(launches: Launches) -> None:
    """Each rank compared its tables with the same one-process reference; the digests
    show the bits directly: one value per scenario over 1, 2, 4 ranks and both backends."""
    seen: dict[str, set[str]] = {}
    for backend, nprocs in EMBEDDING_CASES:
        for scenario, values in launches.digests(backend, nprocs).items():
            seen.setdefault(scenario, set()).update(values)
    assert sorted(seen) == sorted(SCENARIOS), seen
    differ = {s: v for s, v in seen.items() if len(v) != 1}
    assert not differ, f"different final tables across launches: {differ}"


# ------------------------------------------------------------------ one process


class RecordingGroup(comm.LocalGroup):
    """A LocalGroup that records ``(dtype, bytes)`` of every tensor given to alltoallv."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[torch.dtype, int]] = []

    def alltoallv(self, tensor, send_splits, recv_splits=None):  # type: ignore[no-untyped-def,override]
        self.sent.append((tensor.dtype, tensor.numel() * tensor.itemsize))
        return super().alltoallv(tensor, send_splits, recv_splits)


def _table(name: str, dtype: str, dim: int, opt: ps.Optimizer, rows: int = 9) -> TableConfig:
    return TableConfig(
        name=name, num_rows=rows, dim=dim, feature_names=[f"{name}_f"], pooling="sum",
        placement="sharded", optimizer=opt, dtype=dtype,  # type: ignore[arg-type]
    )  # fmt: skip


@pytest.mark.parametrize(
    ("dtypes", "wire", "bytes_per_row"),
    [
        (("fp32",), torch.float32, [4 * 6]),
        (("fp16",), torch.float16, [2 * 6]),
        (("bf16",), torch.bfloat16, [2 * 6]),
        (("fp16", "fp32", "bf16"), torch.uint8, [2 * 6, 4 * 3, 2 * 5]),
    ],
)
def test_rows_travel_in_their_stored_type(
    dtypes: tuple[str, ...], wire: torch.dtype, bytes_per_row: list[int]
) -> None:
    """The rows sent back are the stored bits (2 bytes per narrow element, 4 per float32
    one); their gradients go back in float32, 4 bytes per element."""
    dims = [6, 3, 5][: len(dtypes)]
    pairs = enumerate(zip(dtypes, dims, strict=True))
    cfgs = [_table(f"t{k}", dt, d, ps.SGD(lr=0.1)) for k, (dt, d) in pairs]
    group = RecordingGroup()
    model = ShardedTables(cfgs, group)
    lists = {c.feature_names[0]: [[1, 2, 2], [5]] for c in cfgs}  # 3 unique rows per table
    out = model(KeyedJaggedIds.from_lists(lists))
    sum(o.sum() for o in out.values()).backward()
    moved = [(dt, n) for dt, n in group.sent if dt != torch.int64]  # not counts or ids
    assert moved == [(wire, 3 * sum(bytes_per_row)), (torch.float32, 3 * 4 * sum(dims))], moved


@pytest.mark.parametrize("dtype", NARROW)
def test_sgd_steps_match_plain_torch_and_round_to(dtype: str) -> None:
    """Three SGD steps of one narrow table equal plain torch: initial rows rounded to the
    nearest, then per step the same float32 update (``add_`` with ``alpha``, as
    :class:`ps.SGD`) of the touched rows, stochastically rounded by table id and clock."""
    cfg = _table("t", dtype, 5, ps.SGD(lr=0.01), rows=7)
    spec = cfg.to_spec()
    assert spec.init is not None
    narrow = TORCH_ROW_DTYPES[dtype]
    model = ShardedTables([cfg], comm.LocalGroup())
    want = spec.initial_rows(torch.arange(7)).to(narrow)  # [7, 5]
    clocks = torch.zeros(7, dtype=torch.int64)
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        bags = [[1, 2, 2], [4], [2, 6, step]]
        proj = torch.randn(3, 5, generator=gen)  # [B, D]
        assert_same(model.full_table("t"), want.float(), what=f"step {step} rows", why="same bits")
        out = model(KeyedJaggedIds.from_lists({"t_f": bags}))["t_f"]  # [B, D]
        pooled = torch.stack([want.float()[b].sum(0) for b in bags])
        assert_same(
            out.detach(), pooled, what=f"step {step} output", why="float32 sums, same order"
        )
        (out * proj).sum().backward()
        grad = torch.zeros(7, 5)
        for b, bag in enumerate(bags):
            for i in bag:
                grad[i] += proj[b]  # the gradient of one use: the bag's projection
        touched = torch.unique(torch.tensor([i for bag in bags for i in bag]))
        clocks[touched] += 1
        rows = want.float()[touched].add_(grad[touched], alpha=-0.01)
        want[touched] = round_to(
            rows, narrow, seed=spec.init.seed, ids=touched, versions=clocks[touched]
        )
    assert_same(model.full_table("t"), want.float(), what="final rows", why="same bits")
    assert torch.equal(model.full_clocks("t"), clocks)


@pytest.mark.parametrize("dtype", NARROW)
@pytest.mark.parametrize(
    "opt", [ps.SGD(lr=0.01, momentum=0.9), ps.RowWiseAdagrad(lr=0.05), ps.Adam(lr=0.01)]
)
def test_device_update_equals_host_engine(dtype: str, opt: ps.Optimizer) -> None:
    """The update shards on a device run (``_push_on_device``: the fused path's optimizer
    on float32 copies, then :func:`ps.rounding.round_to`) gives the host engine's bits
    (:class:`ps.local.table.LocalTable`), run here on host tensors: this checks the
    math and the rounding keys where no GPU is at hand (the ``gpu`` test below runs it
    on one).

    Row-wise Adagrad is the exception: the host engine steps a fixed table's rows in its
    C pass, whose mean of squares rounds differently from the torch step (an ulp of
    float32 at times), and an ulp can move a stochastic rounding to the other neighbour.
    There each of the 3 updates may put a row one step of the narrow type off (the
    accumulator, float32 in both, within float32 rounding of its sums)."""
    cfg = _table("t", dtype, 6, opt, rows=10)
    host, device = (ShardedTables([cfg], comm.LocalGroup()) for _ in range(2))
    table = host._shards[0]
    assert table is not None
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        uniq = torch.tensor([0, 3, 4, 9])
        summed = torch.randn(4, 6, generator=gen)
        with table.lock:
            table.push(uniq, summed)
        device._push_on_device([(0, uniq, summed)])
    if isinstance(opt, ps.RowWiseAdagrad):
        got, want = device.full_table("t"), host.full_table("t")
        step = {"fp16": 2.0**-10, "bf16": 2.0**-7}[dtype] * want.abs().amax()  # one ulp, at most
        assert bool(((got - want).abs() <= 3 * step).all()), "rows more than 3 steps apart"
        g_state, w_state = device.full_state("t"), host.full_state("t")
        # float32 sums of 3 means of D = 6 squares, each rounded its own way: 8 ulps
        assert torch.allclose(g_state, w_state, rtol=8 * 2.0**-23, atol=0.0)
        assert torch.equal(device.full_clocks("t"), host.full_clocks("t"))
        return
    for what in ("table", "state", "clocks"):
        get = getattr(ShardedTables, f"full_{what}")
        assert_same(
            get(device, "t"), get(host, "t"), what=what,
            why="the same float32 optimizer on the same rows, rounded with the same keys",
        )  # fmt: skip


@pytest.mark.parametrize("dtype", NARROW)
def test_checkpoint_and_state_dict_conversions(dtype: str, tmp_path: Path) -> None:
    """A narrow table's checkpoint records its dtype and holds float32 rows that load back
    exactly; loaded into a float32 table they are the same values; float32 rows loaded
    into a narrow table round to the nearest; a load that converts warns, naming the
    table and both types; the state dict holds the stored type and converts alike."""
    narrow = TORCH_ROW_DTYPES[dtype]
    cfg = _table("t", dtype, 4, ps.Adam(lr=0.01))
    wide = _table("t", "fp32", 4, ps.Adam(lr=0.01))
    model = ShardedTables([cfg], comm.LocalGroup())
    out = model(KeyedJaggedIds.from_lists({"t_f": [[1, 2], [8]]}))["t_f"]
    out.sum().backward()
    model.save(tmp_path / "narrow")
    ckpt = read_checkpoint(tmp_path / "narrow")
    assert ckpt.spec("t").dtype == dtype
    part = ckpt.read_table("t")
    assert part.weights.dtype == torch.float32
    assert_same(part.weights, model.full_table("t"), what="saved rows", why="exact widening")
    back = ShardedTables([cfg], comm.LocalGroup())
    back.load(tmp_path / "narrow")
    as_wide = ShardedTables([wide], comm.LocalGroup())
    with pytest.warns(UserWarning, match=rf"'t' \({dtype} -> fp32\)"):
        as_wide.load(tmp_path / "narrow")
    for m, what in ((back, "narrow"), (as_wide, "float32")):
        assert_same(m.full_table("t"), model.full_table("t"), what=what, why="exact widening")
        assert_same(m.full_state("t"), model.full_state("t"), what=f"{what} state", why="copied")
    # float32 rows into a narrow table: rounded to the nearest.
    trained_wide = ShardedTables([wide], comm.LocalGroup())
    trained_wide(KeyedJaggedIds.from_lists({"t_f": [[3]]}))["t_f"].sum().backward()
    trained_wide.save(tmp_path / "wide")
    into_narrow = ShardedTables([cfg], comm.LocalGroup())
    with pytest.warns(UserWarning, match=rf"'t' \(fp32 -> {dtype}\)"):
        into_narrow.load(tmp_path / "wide")
    rounded = trained_wide.full_table("t").to(narrow).float()
    why = "a cast rounds to the nearest"
    assert_same(into_narrow.full_table("t"), rounded, what="fp32 rows in a narrow table", why=why)
    sd = model.state_dict()
    assert sd["t.weight"].dtype == narrow
    again = ShardedTables([cfg], comm.LocalGroup())
    again.load_state_dict(sd)
    assert_same(again.full_table("t"), model.full_table("t"), what="state dict", why="copied")
    from_wide = ShardedTables([cfg], comm.LocalGroup())
    with pytest.warns(UserWarning, match=rf"state dict.*'t' \(fp32 -> {dtype}\)"):
        from_wide.load_state_dict(trained_wide.state_dict())
    assert_same(from_wide.full_table("t"), rounded, what="fp32 state dict, narrow table", why=why)


def test_plan_counts_narrow_rows_at_two_bytes() -> None:
    """Bytes per row: 2 per narrow weight element, 4 per float32 one, 4 per state float."""
    cfgs = [
        _table("a", "fp16", 8, ps.RowWiseAdagrad(lr=0.1), rows=10),
        _table("b", "fp32", 8, ps.RowWiseAdagrad(lr=0.1), rows=10),
        _table("c", "bf16", 4, ps.Adam(lr=0.1), rows=10),
    ]
    plan = ShardingPlan.build(cfgs, 3)
    load = plan.bytes_per_rank(cfgs)
    # Adam's state: m, v [D] and a step count: 2 * 4 + 1 floats.
    assert sorted(load) == sorted([10 * (2 * 8 + 4), 10 * (4 * 8 + 4), 10 * (2 * 4 + 4 * 9)])


def test_mixed_bytes_widen_at_any_alignment() -> None:
    """Rows of mixed types packed as bytes come back as the float32 rows, whatever the
    byte offset a chunk starts at (an fp16 chunk of 3 elements puts the next at 6)."""
    dtypes = [torch.float16, torch.float32, torch.bfloat16]
    dims = torch.tensor([3, 2, 1])
    counts = torch.tensor([[1, 2, 1], [0, 1, 3]])  # [W, T] rows per (rank, table)
    wire = wire_dtype(dtypes)
    assert wire == torch.uint8
    gen = torch.Generator().manual_seed(2)
    per_table = [
        torch.randn(int(counts[:, t].sum()), int(dims[t]), generator=gen).to(dtypes[t])
        for t in range(3)
    ]
    packed = pack_rows([r.view(wire) for r in per_table], counts, dtype=wire)
    assert packed.numel() == int((counts * wire_widths(dims, dtypes, wire)).sum())
    got = widen_rows(packed, counts, dims, dtypes)
    want = pack_rows([r.float() for r in per_table], counts)
    assert_same(got, want, what="widened rows", why="narrow rows widen exactly")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", NARROW)
def test_narrow_shards_on_a_gpu(dtype: str) -> None:
    """Shards on a GPU store narrow rows and train like the host: the same float32 math
    (on another device, so within one float32 rounding) rounded with the same bits,
    hence equal rows or, where that rounding tips the narrow one, one narrow step apart."""
    narrow = TORCH_ROW_DTYPES[dtype]
    cfgs = [
        _table("a", dtype, 8, ps.RowWiseAdagrad(lr=0.05)),
        _table("b", dtype, 4, ps.Adam(lr=0.01)),
    ]
    host = ShardedTables(cfgs, comm.LocalGroup())
    gpu = ShardedTables(cfgs, comm.LocalGroup(), device="cuda")
    assert gpu.shard("a")[2].dtype == narrow and gpu.shard("a")[2].is_cuda
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        kjt = KeyedJaggedIds.from_lists({"a_f": [[1, 2, 2], [5]], "b_f": [[0], [7, 8]]})
        proj = {f: torch.randn(2, d, generator=gen) for f, d in (("a_f", 8), ("b_f", 4))}
        for m in (host, gpu):
            out = m(kjt.to(m.device))
            sum((o * proj[f].to(o.device)).sum() for f, o in out.items()).backward()
    for c in cfgs:
        a, b = gpu.full_table(c.name).cpu(), host.full_table(c.name)
        step = torch.maximum(a.abs(), b.abs()) * (2.0**-10 if dtype == "fp16" else 2.0**-7)
        assert bool(((a - b).abs() <= step).all()), f"table {c.name}: {(a - b).abs().max()}"
        assert torch.equal(gpu.full_clocks(c.name).cpu(), host.full_clocks(c.name))
