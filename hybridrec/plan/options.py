"""The planner's command-line options (``python -m hybridrec.plan --help``), also keys of a
``--config plan.toml`` file, and how they become a :class:`hybridrec.plan.spec.Plan`."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Literal

from dense import DLRMConfig
from hybridrec.cli.job_options import CacheOptions
from hybridrec.cli.options import option
from hybridrec.dlrm.job import parse_args
from hybridrec.plan.dense_work import dense_work
from hybridrec.plan.fromjob import plan_from_dlrm
from hybridrec.plan.spec import (
    CachePlan,
    ClusterPlan,
    DevicePlan,
    IdLaw,
    ModelPlan,
    NetworkPlan,
    Plan,
    TablePlan,
)

DEFAULT_SWEEP = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]


@dataclass(kw_only=True, slots=True)
class PlanOptions(CacheOptions):
    # ---- calibration
    calibrate: bool = option(False, help="measure this machine's costs and write them to --out")
    quick: bool = option(False, help="with --calibrate: fewer sizes and repeats (seconds)")
    mpi: bool = option(True, help="with --calibrate: also the MPI store and collectives (mpirun)")
    optimizers: list[str] = option(
        [],
        help="with --calibrate: PS optimizers to time (default: rowwise_adagrad sgd adagrad adam)",
    )
    out: str = option("costs.json", help="with --calibrate: where to write the costs")
    costs: str | None = option(None, help="a calibration file (--calibrate makes one)")
    # ---- the model
    dlrm: str = option(
        "",
        help="the DLRM job's options in one string (written --dlrm=\"--data synthetic "
        '--batch-size 512 --ps mpi:2 --cache-fraction 0.1"): tables, dense shape, batch, '
        "placement, store and cache as the job has them",
    )
    table: list[str] = option(
        [],
        help="tables as NAME:ROWS:DIM[:FEATURES[:POOLING[:PLACEMENT[:OPTIMIZER[:DTYPE]]]]] "
        "(default: --tables tables of --rows x --dim)",
    )
    tables: int = option(26, help="without --table: this many one-hot tables")
    rows: int = option(100_000, help="without --table: rows per table")
    dim: int = option(16, help="without --table: row width")
    emb_dtype: Literal["fp32", "fp16", "bf16"] = option(
        "fp32",
        help="the rows' type where --table gives none: fp32, or fp16 / bf16 (2 bytes per "
        "element in memory and on the store's wire; optimizer state stays fp32)",
    )
    num_dense: int = option(13, help="dense input features")
    bottom_mlp: list[int] = option([64, 16], help="DLRM bottom MLP widths (the last = --dim)")
    top_mlp: list[int] = option([64, 32, 1], help="DLRM top MLP widths (the last = 1)")
    dense_flops: float = option(
        0.0, help="dense FLOPs per sample, forward + backward (0: from the DLRM MLPs)"
    )
    dense_params: int = option(0, help="dense parameters (0: from the DLRM MLPs)")
    placement: Literal["", "local", "hybrid", "sharded"] = option(
        "", help="every table's placement (default: each table's own, hybrid for --tables)"
    )
    # ---- the id law
    zipf: float = option(1.05, help="Zipf exponent of ids in every table (0: uniform)")
    ids_file: str | None = option(
        None, help="sample ids from this file instead: .npy [N, tables] or .npz by table name"
    )
    # ---- the cluster
    workers: int = option(1, help="worker ranks W (the recommendation is for this W)")
    servers: int = option(1, help="PS server ranks S (--store mpi)")
    store: Literal["mpi", "inprocess"] = option("mpi", help="the hybrid tables' store")
    batch_per_worker: int = option(0, help="samples per worker per step")
    global_batch: int = option(0, help="or: samples per step over all workers")
    protocol: Literal["auto", "batched", "per-table"] = option(
        "auto",
        help="PS messages per step: one pull and one push per server for all tables "
        "(batched), one per table (per-table), or what the calibrated store did (auto)",
    )
    sparse_pipeline: bool = option(
        False,
        help="the hybrid tables' sparse step runs on a second thread beside the dense step "
        "(the jobs' --sparse-pipeline on); it hides time where that thread has a core",
    )
    # ---- the cache: CacheOptions (the jobs' flags, with their defaults)
    # ---- network and device
    bandwidth_gbps: float = option(0.0, help="link bandwidth, Gbit/s (0: this machine's)")
    latency_us: float = option(0.0, help="one-way link latency, microseconds")
    device: Literal["cpu", "gpu"] = option("cpu", help="where workers compute")
    shared_cores: int = option(0, help="all W + S processes share this many cores (0: a core each)")
    # ---- the output
    sweep_workers: list[int] = option(DEFAULT_SWEEP, help="the range of W to predict")
    sweep_bandwidth: list[float] = option(
        [10.0, 25.0, 100.0], help="network speeds (Gbit/s) to predict besides --bandwidth-gbps"
    )
    recommend: bool = option(True, help="recommend servers, cache and placement for --workers")
    worker_memory_gb: float = option(64.0, help="a worker's memory, for the local placement")
    png: str | None = option(None, help="write the samples/s and breakdown plot here")
    json: bool = option(False, help="print one JSON object instead of the table")

    def __post_init__(self) -> None:
        if self.batch_per_worker and self.global_batch:
            raise ValueError(
                f"give batch_per_worker or global_batch, not both (got {self.batch_per_worker} "
                f"and {self.global_batch})"
            )
        for name in ("batch_per_worker", "global_batch", "shared_cores", "dense_params"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.dlrm and self.emb_dtype != "fp32":
            raise ValueError(
                f"emb_dtype {self.emb_dtype!r} sets the type of the tables --table and --tables "
                "describe; with dlrm the job's own --emb-dtype / --emb-dtype-of inside the "
                "dlrm string set it"
            )
        if any(w < 1 for w in self.sweep_workers):
            raise ValueError(f"sweep_workers must be ints >= 1, got {self.sweep_workers}")
        if any(not b > 0 for b in self.sweep_bandwidth):
            raise ValueError(f"sweep_bandwidth must be > 0 Gbit/s, got {self.sweep_bandwidth}")


def parse_table(
    text: str, default_optimizer: str = "rowwise_adagrad", default_dtype: str = "fp32"
) -> TablePlan:
    """``NAME:ROWS:DIM[:FEATURES[:POOLING[:PLACEMENT[:OPTIMIZER[:DTYPE]]]]]`` -> TablePlan."""
    parts = text.split(":")
    if not 3 <= len(parts) <= 8:
        raise ValueError(
            f"--table {text!r}: expected NAME:ROWS:DIM[:FEATURES[:POOLING[:PLACEMENT"
            "[:OPTIMIZER[:DTYPE]]]]], e.g. items:1000000:64:1:1:hybrid:rowwise_adagrad:bf16"
        )
    try:
        rows, dim = int(parts[1]), int(parts[2])
        features = int(parts[3]) if len(parts) > 3 else 1
        pooling = float(parts[4]) if len(parts) > 4 else 1.0
    except ValueError:
        raise ValueError(
            f"--table {text!r}: ROWS, DIM and FEATURES must be ints and POOLING a number"
        ) from None
    return TablePlan(
        name=parts[0], rows=rows, dim=dim, features=features, pooling=pooling,
        placement=parts[5] if len(parts) > 5 else "hybrid",
        optimizer=parts[6] if len(parts) > 6 else default_optimizer,
        dtype=parts[7] if len(parts) > 7 else default_dtype,
    )  # fmt: skip


def dense_of(o: PlanOptions, num_sparse: int, dim: int) -> tuple[float, int]:
    if o.dense_flops and o.dense_params:
        return o.dense_flops, o.dense_params
    bottom = list(o.bottom_mlp)
    if bottom[-1] != dim:
        raise ValueError(
            f"bottom_mlp {bottom} must end in the tables' dim {dim} (the DLRM interaction); "
            "or give --dense-flops and --dense-params"
        )
    cfg = DLRMConfig(num_dense=o.num_dense, num_sparse=num_sparse, embedding_dim=dim,
                     bottom_mlp=bottom, top_mlp=list(o.top_mlp))  # fmt: skip
    flops, params = dense_work(cfg)
    return (o.dense_flops or flops), (o.dense_params or params)


def plan_of(o: PlanOptions) -> Plan:
    """The plan the options describe (``--dlrm`` first, then the explicit flags)."""
    network = NetworkPlan(bandwidth_gbps=o.bandwidth_gbps or None, latency_us=o.latency_us)
    device = DevicePlan(kind=o.device, shared_cores=o.shared_cores or None)
    if o.dlrm:
        cfg = parse_args(shlex.split(o.dlrm))
        plan = plan_from_dlrm(cfg, workers=o.workers, network=network, device=device,
                              protocol=o.protocol)  # fmt: skip
        if o.sparse_pipeline:
            plan = plan.with_(sparse_pipeline=True)
        if o.placement:
            plan = plan.with_(model=plan.model.with_placement(o.placement))
        return plan
    if o.table:
        tables = [parse_table(t, default_dtype=o.emb_dtype) for t in o.table]
    else:
        tables = [
            TablePlan(name=f"t{i}", rows=o.rows, dim=o.dim, dtype=o.emb_dtype)
            for i in range(o.tables)
        ]
    dims = {t.dim for t in tables}
    flops, params = dense_of(o, sum(t.features for t in tables), max(dims))
    if not (o.dense_flops and o.dense_params) and len(dims) > 1:
        raise ValueError(
            f"tables of several widths {sorted(dims)}: the DLRM dense shape needs one; give "
            "--dense-flops and --dense-params"
        )
    model = ModelPlan(
        tables=tables, dense_flops_per_sample=flops, dense_params=params, num_dense=o.num_dense,
        law=IdLaw(zipf_a=o.zipf, ids_file=o.ids_file),
    )  # fmt: skip
    if o.placement:
        model = model.with_placement(o.placement)
    if o.global_batch:
        if o.global_batch % o.workers:
            raise ValueError(
                f"global_batch {o.global_batch} must split evenly over {o.workers} workers"
            )
        batch = o.global_batch // o.workers
    else:
        batch = o.batch_per_worker or 512
    cluster = ClusterPlan(
        workers=o.workers, batch_per_worker=batch, servers=o.servers if o.store == "mpi" else 0,
        store=o.store, protocol=o.protocol, sparse_pipeline=o.sparse_pipeline,
    )  # fmt: skip
    cache = CachePlan(
        fraction=o.cache_fraction, rows=o.cache_rows, read_bound=o.read_bound,
        write_bound=o.write_bound, policy=o.cache_policy,
        other_writers=o.other_writers,
    )  # fmt: skip
    return Plan(model=model, cluster=cluster, cache=cache, network=network, device=device)
