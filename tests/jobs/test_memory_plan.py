"""Where a job's memory goes (``hybridrec/launch/memory_plan.py``) and the cache's placement and
sizing options (``--cache-on``, ``--cache-memory``).

The plan's numbers are checked against arithmetic written out here (float32 weights, 2-byte
ones for fp16 and bf16 rows, and
optimizer state plus an int64 clock per row; a device cache's rows, pending sums and the
optimizer state its copies step with, ``2 x D + S`` float32 per cached row), on a DLRM
job with local, hybrid + cache and sharded tables. The CUDA variants (``gpu``) put the
cache on the GPU, size it by ``--cache-memory`` and refuse tables that cannot fit before
allocating them.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

import comm
from cache import CacheConfig, cache_bytes
from embedding import Adam, RowWiseAdagrad, TableConfig
from hybridrec.dlrm.config import DLRMJobConfig
from hybridrec.dlrm.job import DLRMJob
from hybridrec.dlrm.job import parse_args as dlrm_args
from hybridrec.launch.job_cache import cache_config, cache_device, with_cache
from hybridrec.launch.memory_plan import (
    DEVICE,
    HOST,
    MemoryPart,
    MemoryPlan,
    cache_size_fitting,
    dense_bytes,
    human_bytes,
    plan_memory,
)
from hybridrec.launch.roles import store_location
from hybridrec.lm.job import parse_args as lm_args
from ps import InProcessStore, TableSpec

CPU = torch.device("cpu")
ROWS, DIM = 300, 8
JOB_ARGS = [
    "--data", "synthetic", "--synthetic-rows", str(ROWS), "--synthetic-samples", "2000",
    "--batch-size", "64", "--dim", str(DIM), "--bottom-mlp", "16", str(DIM), "--top-mlp", "8",
    "1", "--no-progress", "--backend", "local", "--max-steps", "2",
]  # fmt: skip


def _row(dim: int, state: int) -> int:
    """A stored row: float32 weights and state, one int64 clock."""
    return 4 * dim + 4 * state + 8


def _job(argv: list[str], store: InProcessStore) -> tuple[DLRMJob, dict[str, Any]]:
    job = DLRMJob(dlrm_args(argv), comm.LocalGroup(), store)
    return job, job.close(job.trainer.fit())


# ---------------------------------------------------------------- the plan's arithmetic


def test_plan_of_every_placement_against_arithmetic() -> None:
    """Rank 1 of 2: hybrid tables behind a device cache, a local Adam table, two
    table-wise sharded tables and a row-wise one (3,000,001 rows: rank 1 owns 1,500,000
    of them), a dynamic table that grows with use."""
    rowwise, adam = RowWiseAdagrad(lr=0.1), Adam(lr=0.1)

    def table(name: str, rows: int | None, dim: int, where: Any, opt: Any = rowwise) -> Any:
        return TableConfig(name=name, num_rows=rows, dim=dim, feature_names=[name],
                           placement=where, optimizer=opt)  # fmt: skip

    tables = [
        table("h1", 1000, 16, "hybrid"),
        table("h2", 4000, 16, "hybrid"),
        table("dyn", None, 16, "hybrid"),
        table("loc", 500, 4, "local", adam),
        table("big", 800, 8, "sharded"),
        table("small", 100, 8, "sharded"),
        table("rows", 3_000_001, 2, "sharded"),
    ]
    cache = CacheConfig(capacity_rows=64)
    model = nn.Linear(10, 5)  # 55 float32 weights
    plan = plan_memory(
        tables, device=CPU, store_where="2 PS server ranks", store_remote=True, cache=cache,
        cache_on_device=True, rank=1, world_size=2, dense=dense_bytes(model, 2, 2),
    )  # fmt: skip
    parts = {p.key: p for p in plan.parts}
    assert parts["hybrid_tables"].bytes == (1000 + 4000) * (16 * 4 + 4 + 8)
    assert parts["hybrid_tables"].place == "remote"
    assert plan.dynamic_tables == ("dyn",)
    # Three tables' rows, sums and row-wise Adagrad state (1 float: the local step's).
    assert parts["cache_device"].bytes == 3 * 64 * (2 * 16 + 1) * 4
    specs = [t.to_spec() for t in tables if t.placement == "hybrid"]
    assert parts["cache_host"].bytes == cache_bytes(cache, specs, on_device=True).host
    assert parts["local_tables"].bytes == 500 * _row(4, 2 * 4 + 1)  # Adam: m, v, step
    # The row-wise table gives rank 0 one row more, so the bigger table-wise one goes to
    # rank 1 (the ranks' fewest bytes so far), the smaller to rank 0; together: all rows.
    assert parts["sharded_tables"].bytes == 800 * _row(8, 1) + 1_500_000 * _row(2, 1)
    rank0 = plan_memory(
        tables, device=CPU, store_where="", store_remote=True, cache=None,
        cache_on_device=False, rank=0, world_size=2, dense=0,
    )  # fmt: skip
    both = rank0.parts[-2].bytes + parts["sharded_tables"].bytes
    assert both == 900 * _row(8, 1) + 3_000_001 * _row(2, 1)
    assert parts["dense"].bytes == 55 * 4 * 2 + 55 * 4 * 2 // 2  # weights, grads, half the state
    on_device = ("cache_device", "local_tables", "sharded_tables", "dense")
    assert plan.device_bytes == sum(parts[k].bytes for k in on_device)
    assert plan.host_bytes == parts["cache_host"].bytes  # the store is on the servers
    js = plan.to_json()
    sharded_rows = 800 + 1_500_000  # rank 1's rows: "big" and half of "rows"
    assert js["parts"]["sharded_tables"] == {
        "bytes": parts["sharded_tables"].bytes, "where": "cpu", "place": "device",
        "weights_bytes": 4 * (800 * 8 + 1_500_000 * 2), "state_bytes": 4 * sharded_rows,
        "clock_bytes": 8 * sharded_rows, "dtypes": ["fp32"],
    }  # fmt: skip
    assert all(type(p["bytes"]) is int for p in js["parts"].values())
    text = plan.describe()
    assert "2 PS server ranks" in text and "dyn grows with use" in text
    assert "rank 1's shards of 2" in text
    plan.check()  # a CPU worker: nothing to check against


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_narrow_rows_halve_the_weights_and_keep_the_state(dtype: str) -> None:
    """The same tables in fp32 and in ``dtype``, in every placement: the weights take 2
    bytes per element instead of 4, the optimizer state (row-wise Adagrad 1, Adam
    2 D + 1 floats per row) and the clocks stay as they were; each part says so."""
    rowwise, adam = RowWiseAdagrad(lr=0.1), Adam(lr=0.1)

    def tables(dt: str) -> list[TableConfig]:
        return [
            TableConfig(name="h", num_rows=1000, dim=16, feature_names=["h"],
                        placement="hybrid", optimizer=rowwise, dtype=dt),
            TableConfig(name="loc", num_rows=500, dim=4, feature_names=["loc"],
                        placement="local", optimizer=adam, dtype=dt),
            TableConfig(name="sh", num_rows=800, dim=8, feature_names=["sh"],
                        placement="sharded", optimizer=rowwise, dtype=dt),
        ]  # fmt: skip

    def plan(dt: str) -> MemoryPlan:
        return plan_memory(
            tables(dt), device=CPU, store_where="host (in-process store)", store_remote=False,
            cache=None, cache_on_device=False, rank=0, world_size=1, dense=0,
        )  # fmt: skip

    wide, narrow = plan("fp32").to_json()["parts"], plan(dtype).to_json()["parts"]
    # rows, D, state floats per row of each placement's one table
    shapes = {"hybrid_tables": (1000, 16, 1), "local_tables": (500, 4, 2 * 4 + 1),
              "sharded_tables": (800, 8, 1)}  # fmt: skip
    for key, (rows, dim, state) in shapes.items():
        assert wide[key]["weights_bytes"] == rows * dim * 4
        assert narrow[key]["weights_bytes"] == rows * dim * 2  # half
        for part in (wide[key], narrow[key]):
            assert part["state_bytes"] == rows * state * 4  # float32 whatever the rows
            assert part["clock_bytes"] == rows * 8
            assert part["bytes"] == part["weights_bytes"] + part["state_bytes"] + rows * 8
        assert narrow[key]["bytes"] == rows * (2 * dim + 4 * state + 8)  # TableSpec.row_bytes
        assert (wide[key]["dtypes"], narrow[key]["dtypes"]) == (["fp32"], [dtype])
    text = plan(dtype).describe()
    assert f"(weights 32.0 kB {dtype}, optimizer state 4.0 kB fp32, clocks 8.0 kB)" in text, text
    assert f"weights 4.0 kB {dtype}, optimizer state 18.0 kB fp32" in text, text  # Adam's


def test_store_locations_and_units() -> None:
    assert store_location("local") == ("host (in-process store)", False)
    assert store_location("local", 2) == ("host (in-process store, a replica per worker)", False)
    assert store_location("mpi:3") == ("3 PS server ranks", True)
    assert store_location("redis://h:1/0?cluster=1") == ("Redis Cluster", True)
    assert [human_bytes(n) for n in (512, 53_200_000_000, 1_500_000)] == [
        "512 B", "53.2 GB", "1.5 MB"
    ]  # fmt: skip


def test_device_parts_larger_than_the_gpu_fail_naming_each() -> None:
    gpu = torch.device("cuda", 0)
    plan = MemoryPlan(
        device=gpu, device_total=80 * 10**9, device_name="cuda:0 (a GPU)",
        parts=(MemoryPart("local_tables", "local tables", 70 * 10**9, "cuda:0", DEVICE),
               MemoryPart("cache_device", "cache rows", 12 * 10**9, "cuda:0", DEVICE),
               MemoryPart("cache_host", "cache index", 10**9, "host", HOST)),
    )  # fmt: skip
    with pytest.raises(ValueError) as err:
        plan.check()
    msg = str(err.value)
    for text in ("82.0 GB", "local tables 70.0 GB", "cache rows 12.0 GB", "80.0 GB",
                 "--cache-memory", "--placement hybrid"):  # fmt: skip
        assert text in msg, msg
    assert "cache index" not in msg  # host parts do not count


# ---------------------------------------------------------------- sizing by GPU memory


def _spec(name: str, rows: int | None, dim: int) -> TableSpec:
    return TableSpec(name=name, num_rows=rows, dim=dim, optimizer=RowWiseAdagrad(lr=0.1))


def test_cache_memory_sizes_each_table_within_the_budget() -> None:
    specs = [_spec("a", 10_000, 16), _spec("b", 3, 16), _spec("c", 50_000, 32)]

    def per_row(s: TableSpec) -> int:  # row, pending sum, row-wise Adagrad's state float
        return (2 * s.dim + 1) * 4

    whole = sum(int(s.num_rows or 0) * per_row(s) for s in specs)  # every row of every table
    for budget in (whole // 10, whole // 2, whole - 1):
        size = cache_size_fitting(specs, budget)
        fraction = size["capacity_fraction"]
        rows = [math.ceil(fraction * s.num_rows) for s in specs]  # type: ignore[operator]
        used = sum(r * per_row(s) for r, s in zip(rows, specs, strict=True))
        assert used <= budget
        assert used > budget - sum(per_row(s) for s in specs)  # within a row per table
        assert all(r <= s.num_rows for r, s in zip(rows, specs, strict=True))  # type: ignore[operator]
    assert cache_size_fitting(specs, whole) == {"capacity_fraction": 1.0}
    # A dynamic table: the same rows for every table, at most the smallest fixed table's.
    mixed = [_spec("a", 10_000, 16), _spec("d", None, 16)]
    assert cache_size_fitting(mixed, 100 * 2 * per_row(mixed[0]) + 5) == {"capacity_rows": 100}
    assert cache_size_fitting(mixed, 10**12) == {"capacity_rows": 10_000}
    with pytest.raises(ValueError, match="less than one cached row of each table"):
        cache_size_fitting(specs, 100)


def test_cache_options_are_checked() -> None:
    with pytest.raises(ValueError, match=r"--cache-memory or --cache-rows, not both \(got "
                       r"--cache-memory 0\.1 and --cache-rows 10\)"):  # fmt: skip
        dlrm_args(["--cache-memory", "0.1", "--cache-rows", "10"])
    with pytest.raises(ValueError, match="--cache-memory 0.1 and --cache-fraction 0.2"):
        lm_args(["--cache-memory", "0.1", "--cache-fraction", "0.2", "--placement", "hybrid"])
    with pytest.raises(ValueError, match=r"--cache-memory must be in \(0, 1\]"):
        dlrm_args(["--cache-memory", "1.5"])
    with pytest.raises(ValueError, match="sizes a cache whose rows are on the GPU, but "
                       "--cache-on is 'host'"):  # fmt: skip
        dlrm_args(["--cache-memory", "0.1", "--cache-on", "host"])
    with pytest.raises(ValueError, match="invalid choice: 'gpu'"):
        dlrm_args(["--cache-on", "gpu"])
    specs = [_spec("a", 100, 8)]
    cfg = DLRMJobConfig(cache_memory=0.1)
    with pytest.raises(ValueError, match="--cache-memory 0.1 sizes a cache whose rows are on "
                       "the GPU, but this worker trains on cpu"):  # fmt: skip
        cache_config(cfg, specs, CPU)
    with pytest.raises(ValueError, match="--cache-on device keeps the cache's rows on the "
                       "worker's GPU, but this worker trains on cpu"):  # fmt: skip
        cache_config(DLRMJobConfig(cache_rows=5, cache_on="device"), specs, CPU)
    assert cache_config(DLRMJobConfig(), specs, CPU) is None
    # The placement alone needs no GPU to decide: auto and device put a GPU worker's cache
    # rows on its GPU, host keeps them in host records; a CPU worker always has those.
    gpu = torch.device("cuda", 1)
    for on, want in (("auto", gpu), ("device", gpu), ("host", None)):
        assert cache_device(DLRMJobConfig(cache_rows=5, cache_on=on), gpu) == want  # type: ignore[arg-type]
        if on != "device":
            assert cache_device(DLRMJobConfig(cache_rows=5, cache_on=on), CPU) is None  # type: ignore[arg-type]


def test_cache_on_host_is_the_cpu_cache() -> None:
    store = InProcessStore()
    for on in ("host", "auto"):
        cfg = DLRMJobConfig(cache_rows=7, cache_on=on)  # type: ignore[arg-type]
        assert cache_config(cfg, [], CPU) == CacheConfig(capacity_rows=7, group_tables=True)
        plain = DLRMJobConfig(cache_rows=7, cache_on=on, counted_pushes=False)  # type: ignore[arg-type]
        assert cache_config(plain, [], CPU) == CacheConfig(
            capacity_rows=7, group_tables=True, counted_pushes=False
        )
        by_sgd = DLRMJobConfig(cache_rows=7, cache_on=on, local_step="sgd")  # type: ignore[arg-type]
        assert cache_config(by_sgd, [], CPU) == CacheConfig(
            capacity_rows=7, group_tables=True, local_step="sgd"
        )
        cached = with_cache(cfg, store, comm.LocalGroup(), CPU)
        assert cached is not None
        assert cached.device is None  # records in host memory
        cached.close()


# ---------------------------------------------------------------- the jobs


def test_dlrm_job_prints_its_memory_and_reports_it(capsys: pytest.CaptureFixture[str]) -> None:
    """Local, hybrid behind a 10 % cache and sharded tables of the synthetic data (26
    tables of ROWS rows, row-wise Adagrad), one process: the plan against arithmetic."""
    argv = [*JOB_ARGS, "--placement", "hybrid", "--cache-fraction", "0.1",
            "--placement-of", "cat0=local", "cat1=local", "cat2=sharded"]  # fmt: skip
    store = InProcessStore()
    job, result = _job(argv, store)
    assert store.init_device is None  # a CPU worker's store hashes its rows with numpy
    out = capsys.readouterr().out
    header = out.index("DLRM on synthetic")
    block = out.index("memory of worker rank 0 and its store:")
    assert block > header
    for line in ("hybrid tables", "cache", "local tables", "sharded tables", "dense"):
        assert f"\n  {line}" in out[block:], out
    mem = result["memory"]
    parts = {k: v["bytes"] for k, v in mem["parts"].items()}
    row = _row(DIM, 1)
    capacity = math.ceil(0.1 * ROWS)
    assert parts["hybrid_tables"] == 23 * ROWS * row
    assert parts["local_tables"] == 2 * ROWS * row
    assert parts["sharded_tables"] == ROWS * row
    assert "cache_device" not in parts  # a CPU worker: the host cache
    # A host record per cached row (row, pending sum, 64 bytes of metadata, whose spare
    # word holds the row-wise Adagrad state its copy steps with; whole 64-byte lines), the
    # slot's 25 bytes (row id, eviction key, free-stack entry, a byte of its push count),
    # and a 4-byte id -> slot entry per table row.
    record = math.ceil((2 * DIM * 4 + 64) / 64) * 64
    assert parts["cache_host"] == 23 * (capacity * (record + 25) + ROWS * 4)
    weights = sum(p.numel() for p in job.model.dense.parameters()) * 4
    assert parts["dense"] == 4 * weights  # weights, gradients, Adam's two moments
    assert mem["device"] == "cpu" and mem["device_total_bytes"] == 0
    assert mem["device_bytes"] == parts["local_tables"] + parts["sharded_tables"] + parts["dense"]
    assert result["steps"] == 2


# ---------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_dlrm_cache_on_the_gpu_sized_by_its_memory(capsys: pytest.CaptureFixture[str]) -> None:
    """--cache-memory 0.001 of the GPU: 26 tables of 100,000 x 8 rows do not all fit
    there (166 MB of rows and pending sums), so each caches the same share of its rows."""
    rows = 100_000
    argv = [*JOB_ARGS, "--device", "cuda", "--placement", "hybrid", "--cache-memory", "0.001",
            "--synthetic-rows", str(rows), "--max-steps", "5"]  # fmt: skip
    store = InProcessStore()
    job, result = _job(argv, store)
    assert store.init_device == job.device  # the store's initial rows hashed on the GPU
    assert job.cached is not None
    assert job.cached.device is not None and job.cached.device.type == "cuda"
    total = torch.cuda.get_device_properties(job.device).total_memory
    name = torch.cuda.get_device_properties(job.device).name
    out = capsys.readouterr().out
    assert f"on {job.device} ({name}): " in out, out
    mem = result["memory"]
    cached = mem["parts"]["cache_device"]
    assert cached["place"] == "device" and cached["where"] == str(job.device)
    budget = int(0.001 * total)
    assert budget - 26 * 2 * DIM * 4 < cached["bytes"] <= min(budget, 26 * rows * 2 * DIM * 4)
    assert mem["device_total_bytes"] == total
    assert result["steps"] == 5 and result["cache"]


@pytest.mark.gpu
def test_tables_larger_than_the_gpu_fail_before_allocating() -> None:
    gpu = comm.resolve_device("cuda")
    total = torch.cuda.get_device_properties(gpu).total_memory
    rows = total // (4 * 128 + 4 + 8) + 1  # one row more than the GPU holds
    tables = [TableConfig(name="huge", num_rows=rows, dim=128, feature_names=["f"],
                          optimizer=RowWiseAdagrad(lr=0.1))]  # fmt: skip
    plan = plan_memory(
        tables, device=gpu, store_where="host (in-process store)", store_remote=False,
        cache=None, cache_on_device=False, rank=0, world_size=1, dense=0,
    )  # fmt: skip
    with pytest.raises(ValueError, match=f"local tables {human_bytes(plan.device_bytes)}"):
        plan.check()
