"""What the planner is asked about: the model, the id law, the cluster, the network, the device.

Plain dataclasses, checked in ``__post_init__``; a bad value raises ``ValueError``
naming the field, the value and what was expected. :class:`Plan` bundles one of each;
``Plan.with_(workers=64)`` gives a variant (the range sweeps and the recommendation
use it).

    Plan
     ├─ model:   ModelPlan(tables=[TablePlan, ...], num_dense, dense_flops_per_sample,
     │                     dense_params, law=IdLaw)
     ├─ cluster: ClusterPlan(workers W, servers S, store, batch_per_worker, protocol)
     ├─ cache:   CachePlan(fraction | rows, read_bound, write_bound, policy)
     ├─ network: NetworkPlan(bandwidth_gbps, latency_us)   (None: this machine's links)
     └─ device:  DevicePlan(kind, shared_cores)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import ps
from ps.table import ROW_DTYPES

PLACEMENTS = ("local", "hybrid", "sharded")
# The store's optimizers by kind (``TablePlan.optimizer``), as ps builds them: what a row
# keeps besides its weights is their ``state_dim`` (the learning rates do not matter here).
OPTIMIZERS: dict[str, ps.Optimizer] = {
    "sgd": ps.SGD(lr=0.01), "rowwise_adagrad": ps.RowWiseAdagrad(lr=0.01),
    "adagrad": ps.Adagrad(lr=0.01), "adam": ps.Adam(lr=0.01), "ftrl": ps.FTRL(alpha=0.01),
}  # fmt: skip
STORES = ("mpi", "inprocess")
PROTOCOLS = ("auto", "batched", "per-table")
POLICIES = ("lfu", "lru", "tinylfu")
DEVICES = ("cpu", "gpu")


def _int_at_least(owner: str, name: str, value: object, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{owner}.{name} must be an int >= {low}, got {value!r}")


def _positive(owner: str, name: str, value: object) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"{owner}.{name} must be a number > 0, got {value!r}")


def _one_of(owner: str, name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{owner}.{name} must be one of {allowed}, got {value!r}")


@dataclass(kw_only=True, slots=True)
class TablePlan:
    """One embedding table: ``rows`` x ``dim`` of ``dtype`` ("fp32", or "fp16" / "bf16":
    2 bytes per element, in memory and on the parameter server's wire), read by
    ``features`` sparse features with ``pooling`` ids per sample each (1 for a one-hot
    feature); ``optimizer``: the store's optimizer kind (:data:`OPTIMIZERS`), whose
    float32 state each row keeps too."""

    name: str
    rows: int
    dim: int
    features: int = 1
    pooling: float = 1.0
    placement: str = "hybrid"
    optimizer: str = "rowwise_adagrad"
    dtype: str = "fp32"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"TablePlan.name must be a non-empty string, got {self.name!r}")
        who = f"TablePlan({self.name!r})"
        _int_at_least(who, "rows", self.rows, 1)
        _int_at_least(who, "dim", self.dim, 1)
        _int_at_least(who, "features", self.features, 1)
        _positive(who, "pooling", self.pooling)
        _one_of(who, "placement", self.placement, PLACEMENTS)
        _one_of(who, "optimizer", self.optimizer, tuple(OPTIMIZERS))
        _one_of(who, "dtype", self.dtype, ROW_DTYPES)

    @property
    def element_bytes(self) -> int:
        """Bytes of one weight: 4 for fp32 rows, 2 for fp16 and bf16."""
        return 4 if self.dtype == "fp32" else 2

    @property
    def row_bytes(self) -> int:
        """Bytes a stored row takes (``ps.TableSpec.row_bytes``): weights of
        :attr:`element_bytes`, the optimizer's float32 state, an int64 clock."""
        return ps.TableSpec(
            name=self.name, num_rows=self.rows, dim=self.dim,
            optimizer=OPTIMIZERS[self.optimizer], dtype=self.dtype,  # type: ignore[arg-type]
        ).row_bytes  # fmt: skip

    def draws(self, batch: int) -> int:
        """Ids one worker looks up in this table per step (``batch`` samples)."""
        return max(1, round(batch * self.features * self.pooling))


@dataclass(kw_only=True, slots=True)
class IdLaw:
    """How ids are drawn: Zipf(``zipf_a``) over each table's rows (rank ``k`` with
    probability ``~ k**-a``; ``zipf_a`` 0 is uniform), or the ids of a data file
    (``ids_file``: ``.npy`` ``[N, T]`` or ``.npz`` with one array per table name)."""

    zipf_a: float = 1.05
    ids_file: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.zipf_a, int | float) or self.zipf_a < 0:
            raise ValueError(f"IdLaw.zipf_a must be a number >= 0, got {self.zipf_a!r}")
        _int_at_least("IdLaw", "seed", self.seed, 0)


@dataclass(kw_only=True, slots=True)
class ModelPlan:
    """The tables, and the dense part's work: ``dense_flops_per_sample`` (forward +
    backward) and ``dense_params`` (what the allreduce averages, float32)."""

    tables: list[TablePlan]
    dense_flops_per_sample: float
    dense_params: int
    num_dense: int = 13
    law: IdLaw = field(default_factory=IdLaw)

    def __post_init__(self) -> None:
        if not self.tables:
            raise ValueError("ModelPlan.tables must list at least one TablePlan, got none")
        names = [t.name for t in self.tables]
        if len(set(names)) != len(names):
            raise ValueError(f"ModelPlan.tables: table names must be distinct, got {names}")
        _positive("ModelPlan", "dense_flops_per_sample", self.dense_flops_per_sample)
        _int_at_least("ModelPlan", "dense_params", self.dense_params, 0)
        _int_at_least("ModelPlan", "num_dense", self.num_dense, 0)

    def placed(self, placement: str) -> list[TablePlan]:
        return [t for t in self.tables if t.placement == placement]

    def with_placement(self, placement: str) -> ModelPlan:
        """Every table moved to ``placement``."""
        _one_of("ModelPlan.with_placement", "placement", placement, PLACEMENTS)
        tables = [dataclasses.replace(t, placement=placement) for t in self.tables]
        return dataclasses.replace(self, tables=tables)


@dataclass(kw_only=True, slots=True)
class CachePlan:
    """The worker-side hot-row cache of hybrid tables (``cache.CacheConfig``): size as a
    ``fraction`` of each table's rows or ``rows`` per table (0 and 0: no cache).
    One worker's cache is its tables' sole writer unless ``other_writers``."""

    fraction: float = 0.0
    rows: int = 0
    read_bound: int = 0
    write_bound: int = 0
    policy: str = "lfu"
    other_writers: bool = False  # others write the tables too: no sole writer at 1 worker

    def __post_init__(self) -> None:
        if not isinstance(self.fraction, int | float) or not 0 <= self.fraction <= 1:
            raise ValueError(f"CachePlan.fraction must be in [0, 1], got {self.fraction!r}")
        _int_at_least("CachePlan", "rows", self.rows, 0)
        if self.rows and self.fraction:
            raise ValueError(
                f"CachePlan: give rows or fraction, not both (got {self.rows} and {self.fraction})"
            )
        _int_at_least("CachePlan", "read_bound", self.read_bound, 0)
        _int_at_least("CachePlan", "write_bound", self.write_bound, 0)
        _one_of("CachePlan", "policy", self.policy, POLICIES)
        if not isinstance(self.other_writers, bool):
            raise ValueError(f"CachePlan.other_writers must be a bool, got {self.other_writers!r}")

    def sole_writer(self, workers: int) -> bool:
        """Whether the cache of each of ``workers`` is its tables' only writer (one
        worker, nobody else writing): it then asks the store only about misses and rows
        it pushed more than ``read_bound`` times since their read."""
        return workers == 1 and not self.other_writers

    @property
    def on(self) -> bool:
        return bool(self.rows or self.fraction)

    def capacity(self, table_rows: int) -> int:
        """Rows the cache holds for a table of ``table_rows`` rows."""
        if self.rows:
            return min(self.rows, table_rows)
        return min(table_rows, max(1, int(self.fraction * table_rows))) if self.fraction else 0


@dataclass(kw_only=True, slots=True)
class ClusterPlan:
    """``workers`` W training ranks, each with ``batch_per_worker`` samples per step;
    ``servers`` S single-threaded PS ranks (``store`` "mpi"), or an in-process store in
    each worker ("inprocess"). ``protocol``: how many messages a step sends each server:
    one pull and one push for all tables ("batched"), one per table ("per-table"), or
    what the calibrated store did ("auto"). ``sparse_pipeline``: the hybrid tables'
    pull, push and the cache's work run on a second thread of each worker beside the
    dense step (the jobs' ``--sparse-pipeline``); it hides time only where that thread
    has a core of its own."""

    workers: int
    batch_per_worker: int
    servers: int = 1
    store: str = "mpi"
    protocol: str = "auto"
    sparse_pipeline: bool = False

    def __post_init__(self) -> None:
        _int_at_least("ClusterPlan", "workers", self.workers, 1)
        _int_at_least("ClusterPlan", "batch_per_worker", self.batch_per_worker, 1)
        _int_at_least("ClusterPlan", "servers", self.servers, 0)
        _one_of("ClusterPlan", "store", self.store, STORES)
        _one_of("ClusterPlan", "protocol", self.protocol, PROTOCOLS)
        if self.store == "mpi" and self.servers < 1:
            raise ValueError("ClusterPlan.servers must be >= 1 with store 'mpi', got 0")


@dataclass(kw_only=True, slots=True)
class NetworkPlan:
    """Links between machines: ``bandwidth_gbps`` per link (Gbit/s) and one-way
    ``latency_us``; ``bandwidth_gbps`` None means this machine's own links (what the
    calibration measured: shared memory between local processes)."""

    bandwidth_gbps: float | None = None
    latency_us: float = 0.0

    def __post_init__(self) -> None:
        if self.bandwidth_gbps is not None:
            _positive("NetworkPlan", "bandwidth_gbps", self.bandwidth_gbps)
        if not isinstance(self.latency_us, int | float) or self.latency_us < 0:
            raise ValueError(f"NetworkPlan.latency_us must be >= 0, got {self.latency_us!r}")

    @property
    def label(self) -> str:
        return "this machine" if self.bandwidth_gbps is None else f"{self.bandwidth_gbps:g} Gb/s"


@dataclass(kw_only=True, slots=True)
class DevicePlan:
    """Where a worker computes: "cpu" (one core per process unless ``shared_cores``
    says all W + S processes share that many cores) or "gpu" (one per worker; needs
    costs calibrated on a GPU machine)."""

    kind: str = "cpu"
    shared_cores: int | None = None

    def __post_init__(self) -> None:
        _one_of("DevicePlan", "kind", self.kind, DEVICES)
        if self.shared_cores is not None:
            _int_at_least("DevicePlan", "shared_cores", self.shared_cores, 1)


@dataclass(kw_only=True, slots=True)
class Plan:
    model: ModelPlan
    cluster: ClusterPlan
    cache: CachePlan = field(default_factory=CachePlan)
    network: NetworkPlan = field(default_factory=NetworkPlan)
    device: DevicePlan = field(default_factory=DevicePlan)

    def __post_init__(self) -> None:
        hybrid = self.model.placed("hybrid")
        if self.cache.on and not hybrid:
            raise ValueError(
                "CachePlan: the cache serves hybrid tables, but no table is hybrid "
                f"(placements {sorted({t.placement for t in self.model.tables})})"
            )

    def with_(self, **changes: Any) -> Plan:
        """A copy with cluster fields (workers, servers, batch_per_worker, store,
        protocol) or whole parts (model, cache, network, device) replaced."""
        parts = {k: changes.pop(k) for k in ("model", "cache", "network", "device") if k in changes}
        cluster = dataclasses.replace(self.cluster, **changes) if changes else self.cluster
        return dataclasses.replace(self, cluster=cluster, **parts)
