"""A :class:`Plan` from the DLRM job's own options (``hybridrec train-dlrm ...``).

    plan = plan_from_dlrm(parse_args(["--data", "synthetic", "--ps", "mpi:2",
                                      "--batch-size", "512"]), workers=2)

The tables, dense shape, batch, placement, store and cache are the job's: one table per
sparse feature (26 for synthetic and Criteo data), the job's row-wise Adagrad, its
``--placement`` / ``--placement-of`` rules, its rows' types (``--emb-dtype`` /
``--emb-dtype-of``), ``--batch-size`` split over the workers,
``--ps mpi:S`` servers and the ``--cache-*`` options. The id law is the synthetic data's
Zipf(1.05), or the one given for Criteo files (their skew is not known up front).
"""

from __future__ import annotations

from dense import DLRMConfig
from hybridrec.dlrm.config import DLRMJobConfig
from hybridrec.dlrm.data import Feature
from hybridrec.dlrm.job import resolve_placements
from hybridrec.launch.roles import parse_ps
from hybridrec.plan.dense_work import dense_work
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

SYNTHETIC_ZIPF = 1.05  # hybridrec.datasets.synthetic's default law
NUM_SPARSE, NUM_DENSE = 26, 13


def dense_shape(cfg: DLRMJobConfig, num_sparse: int, num_dense: int) -> tuple[float, int]:
    """``(FLOPs per sample forward + backward, parameters)`` of the job's dense model."""
    assert cfg.dim is not None and cfg.top_mlp is not None and cfg.interaction is not None
    config = DLRMConfig(
        num_dense=num_dense, num_sparse=num_sparse, embedding_dim=cfg.dim,
        bottom_mlp=list(cfg.bottom_mlp or [64, cfg.dim]), top_mlp=list(cfg.top_mlp),
        interaction=cfg.interaction, dcn_layers=cfg.dcn_layers, dcn_rank=cfg.dcn_rank,
    )  # fmt: skip
    return dense_work(config)


def plan_from_dlrm(
    cfg: DLRMJobConfig,
    *,
    workers: int,
    zipf_a: float | None = None,
    network: NetworkPlan | None = None,
    device: DevicePlan | None = None,
    protocol: str = "auto",
) -> Plan:
    """The plan of ``cfg`` run on ``workers`` worker ranks (plus ``--ps mpi:S`` servers)."""
    if cfg.data == "synthetic":
        rows, law = cfg.synthetic_rows, IdLaw(zipf_a=SYNTHETIC_ZIPF if zipf_a is None else zipf_a)
        names = [f"cat{i}" for i in range(NUM_SPARSE)]
    elif cfg.data == "criteo":
        if cfg.criteo_rows == 0:
            raise ValueError(
                "plan_from_dlrm: --criteo-rows 0 (dynamic tables) has no fixed size to plan "
                "for; give --criteo-rows N"
            )
        rows, law = cfg.criteo_rows, IdLaw(zipf_a=SYNTHETIC_ZIPF if zipf_a is None else zipf_a)
        names = [f"C{i}" for i in range(1, NUM_SPARSE + 1)]
    else:
        raise ValueError(
            f"plan_from_dlrm: data {cfg.data!r} has tables known only after reading it; "
            "the planner takes synthetic and criteo options (or give the tables with --table)"
        )
    if cfg.batch_size % workers:
        raise ValueError(
            f"plan_from_dlrm: --batch-size {cfg.batch_size} must split evenly over "
            f"{workers} workers"
        )
    features = [Feature(n, rows) for n in names]
    placements = resolve_placements(cfg, features)
    dtypes = cfg.table_dtypes(names)
    assert cfg.dim is not None
    tables = [
        TablePlan(name=n, rows=rows, dim=cfg.dim, placement=placements[n], dtype=dtypes[n])
        for n in names
    ]
    flops, params = dense_shape(cfg, NUM_SPARSE, NUM_DENSE)
    model = ModelPlan(
        tables=tables, dense_flops_per_sample=flops, dense_params=params, num_dense=NUM_DENSE,
        law=law,
    )  # fmt: skip
    choice = parse_ps(cfg.ps)
    if choice.kind == "redis":
        raise ValueError("plan_from_dlrm: the planner models MPI and in-process stores, not Redis")
    mpi = choice.kind == "mpi"
    # --sparse-pipeline auto turns it on for a store the ranks share (or one rank) where
    # a core is free; whether one is, is the plan's device (predict hides nothing without)
    pipeline = cfg.sparse_pipeline == "on" or (
        cfg.sparse_pipeline == "auto" and (mpi or workers == 1)
    )
    cluster = ClusterPlan(
        workers=workers, batch_per_worker=cfg.batch_size // workers,
        servers=choice.num_servers if mpi else 0, store="mpi" if mpi else "inprocess",
        protocol=protocol, sparse_pipeline=pipeline,
    )  # fmt: skip
    if getattr(cfg, "cache_memory", 0.0):
        raise ValueError(
            f"plan_from_dlrm: --cache-memory {cfg.cache_memory} sizes a GPU cache from the "
            "GPU's memory when the job starts; give the planner the cache's size as "
            "--cache-fraction or --cache-rows (the job prints the size it chose)"
        )
    cache = CachePlan(
        fraction=cfg.cache_fraction, rows=cfg.cache_rows, read_bound=cfg.read_bound,
        write_bound=cfg.write_bound, policy=cfg.cache_policy,
        other_writers=cfg.other_writers,
    )  # fmt: skip
    return Plan(
        model=model, cluster=cluster, cache=cache, network=network or NetworkPlan(),
        device=device or DevicePlan(),
    )  # fmt: skip
