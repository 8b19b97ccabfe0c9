"""Where a job's memory goes, worked out before anything is allocated.

A job builds a :class:`MemoryPlan` from its table configs, their placements, the
``--ps`` store, the cache's settings and its dense model, prints it at start, puts
:meth:`MemoryPlan.to_json` in its result under ``"memory"`` and calls
:meth:`MemoryPlan.check`, which stops a run whose parts on the worker's GPU exceed
that GPU's memory before a single table is allocated there.

Bytes per part (``D`` = dim, ``S`` = the table optimizer's state columns,
``ps.TableSpec.state_dim``):

* **hybrid tables**, in the store (the host's in-process store, PS server ranks or
  Redis): ``num_rows x (E D + 4 S + 8)`` (``ps.TableSpec.row_bytes``): weights of
  ``E`` bytes per element (4 for fp32 rows, 2 for fp16 and bf16: the table's
  ``dtype``), float32 optimizer state and an int64 clock per row, as ``ps`` keeps
  them (Redis adds its own per-key overhead). A dynamic table has no size yet: it
  grows with the ids seen (up to its ``capacity`` when it has one);
* **cache** (:func:`cache.cache_bytes`): rows and pending sums on the worker's GPU
  when the cache is there, the slots, the id -> slot map and the metadata on the
  host (all of it on the host for a host cache);
* **local tables**: every row, on the worker's device, as in the store;
* **sharded tables**: this rank's rows of each (:class:`embedding.sharding_plan.
  ShardingPlan`, the plan the collection builds), on the worker's device;
* **dense**: the weights, their gradients and the optimizer state (``state_per_
  parameter`` values per weight, divided over the ranks that shard it), on the
  worker's device. Activations and allocator slack are not counted.

Each table part also says what its bytes hold (:class:`TableBytes`): the weights in
their row types, the optimizer state and the clocks, so a narrow table's saving (half
the weights) is seen beside the state it does not shrink.

On a CPU worker the "device" parts are in host memory and nothing is checked.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cache import CacheConfig, cache_bytes, rows_fitting
from embedding import TableConfig
from embedding.sharding_plan import ShardingPlan
from ps import TableSpec

CLOCK_BYTES = 8  # one int64 clock per row
STATE_BYTES = 4  # optimizer state is float32 whatever the rows' type


def row_bytes(spec: TableSpec) -> int:
    """Bytes one row of ``spec`` takes in a store, a local table or a shard: weights of
    its ``dtype``, float32 optimizer state, an int64 clock (``TableSpec.row_bytes``)."""
    return spec.row_bytes


@dataclass(frozen=True, slots=True)
class TableBytes:
    """What the rows of some tables hold: ``weights`` (in the row types ``dtypes``),
    float32 optimizer ``state`` and int64 ``clocks``, in bytes."""

    weights: int = 0
    state: int = 0
    clocks: int = 0
    dtypes: tuple[str, ...] = ()  # the weights' types, each once, in the tables' order

    @property
    def total(self) -> int:
        return self.weights + self.state + self.clocks

    def plus(self, spec: TableSpec, rows: int) -> TableBytes:
        """These bytes and those of ``rows`` rows of ``spec``."""
        weights = rows * spec.dim * spec.torch_dtype.itemsize
        state = rows * STATE_BYTES * spec.state_dim
        out = TableBytes(
            self.weights + weights,
            self.state + state,
            self.clocks + rows * CLOCK_BYTES,
            self.dtypes if spec.dtype in self.dtypes else (*self.dtypes, spec.dtype),
        )
        assert weights + state + rows * CLOCK_BYTES == rows * spec.row_bytes, spec
        return out

    def describe(self) -> str:
        """``"weights 1.2 MB bf16, optimizer state 0.3 MB fp32, clocks 0.2 MB"``."""
        text = f"weights {human_bytes(self.weights)} {'/'.join(self.dtypes)}"
        if self.state:
            text += f", optimizer state {human_bytes(self.state)} fp32"
        return text + f", clocks {human_bytes(self.clocks)}"


def human_bytes(n: int) -> str:
    """``53_200_000_000`` -> ``"53.2 GB"`` (powers of 1000, as disks and GPUs are sold)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def device_memory(device: torch.device) -> int:
    """Total memory of a CUDA ``device`` in bytes; 0 for any other device."""
    if device.type != "cuda":
        return 0
    return int(torch.cuda.get_device_properties(device).total_memory)


def describe_where(device: torch.device) -> str:
    """``"cuda:0 (NVIDIA H200)"``, or the device alone (``"cpu"``)."""
    if device.type != "cuda":
        return str(device)
    return f"{device} ({torch.cuda.get_device_properties(device).name})"


# ---------------------------------------------------------------- sizing a GPU cache


def cache_size_fitting(
    specs: Sequence[TableSpec], budget: int, config: CacheConfig | None = None
) -> dict[str, Any]:
    """The cache size whose rows and pending sums on a device (caches of every table of
    ``specs``; ``config``: the cache's other settings, whose bounds decide whether it
    holds counted pushes' statistics too) take at most ``budget`` bytes there, as
    :class:`cache.CacheConfig` keywords: ``{"capacity_fraction": f}`` when every table
    is fixed (each caches the same share of its rows, at most all of them), else
    ``{"capacity_rows": r}`` (the same rows for every table, :func:`cache.rows_fitting`,
    at most the smallest fixed table's rows). ValueError when the budget holds less than
    one row per table."""
    if not specs:
        raise ValueError("sizing a cache by memory: no tables to cache")
    base = CacheConfig(capacity_rows=1) if config is None else config

    def sized(**size: Any) -> CacheConfig:
        return dataclasses.replace(
            base, **{"capacity_rows": None, "capacity_fraction": None, **size}
        )

    one_row = cache_bytes(sized(capacity_rows=1), specs, on_device=True).device
    if budget < one_row:
        names = ", ".join(s.name for s in specs)
        raise ValueError(
            f"--cache-memory: {human_bytes(budget)} of the GPU holds less than one cached row "
            f"of each table ({names}: {one_row} bytes); give a larger fraction"
        )
    fixed = [s.num_rows for s in specs if s.num_rows is not None]
    if len(fixed) < len(specs):
        rows = rows_fitting(specs, budget, base)
        return {"capacity_rows": min([rows, *fixed])}
    whole = cache_bytes(sized(capacity_fraction=1.0), specs, on_device=True).device
    if whole <= budget:
        return {"capacity_fraction": 1.0}
    # ceil(f x N) <= f x N + 1 rows per table: f = (budget - one_row) / whole fits.
    fraction = (budget - one_row) / whole
    while fraction > 0:
        taken = cache_bytes(sized(capacity_fraction=fraction), specs, on_device=True)
        if taken.device <= budget:
            break
        fraction = math.nextafter(fraction, 0.0) * (1 - 1e-9)  # float rounding only
    assert fraction > 0, (budget, one_row, whole)  # budget >= one_row: some fraction fits
    return {"capacity_fraction": fraction}


# ---------------------------------------------------------------- the plan


DEVICE, HOST, REMOTE = "device", "host", "remote"  # a part's place


@dataclass(frozen=True, slots=True)
class MemoryPart:
    """One part of the job's memory: ``bytes`` in ``where``; ``place``: on the worker's
    device (counted against its GPU's memory), in its host memory, or remote (PS server
    ranks, Redis); ``note``: what it holds; ``tables``: for a part of table rows, the
    bytes of their weights, optimizer state and clocks."""

    key: str  # JSON key: "hybrid_tables", "cache_device", "cache_host", ...
    label: str  # printed name: "hybrid tables", "cache rows", ...
    bytes: int
    where: str  # "cuda:0", "host (in-process store)", "2 PS server ranks", "Redis"
    place: str  # DEVICE, HOST or REMOTE
    note: str = ""
    tables: TableBytes | None = None

    @property
    def notes(self) -> str:
        """``note`` and, for table rows that have a size, what their bytes hold."""
        held = self.tables.describe() if self.tables is not None and self.bytes else ""
        return "; ".join(filter(None, [self.note, held]))


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """The parts of one worker's run and where they live (see the module doc)."""

    device: torch.device
    device_total: int  # the GPU's memory in bytes; 0 on a CPU worker
    device_name: str  # "cuda:0 (NVIDIA H200)" or "cpu"
    parts: tuple[MemoryPart, ...]
    dynamic_tables: tuple[str, ...] = ()  # hybrid tables whose size grows with use
    rank: int = 0  # the worker whose parts these are (sharded tables differ per rank)

    @property
    def device_bytes(self) -> int:
        """Bytes of every part on the worker's device."""
        return sum(p.bytes for p in self.parts if p.place == DEVICE)

    @property
    def host_bytes(self) -> int:
        """Bytes of the parts in this worker's host memory (not the PS servers' or Redis's;
        a CPU worker's device parts are in host memory too)."""
        return sum(p.bytes for p in self.parts if p.place == HOST)

    def check(self) -> None:
        """ValueError, naming every part on the GPU and its size, when they exceed it."""
        if self.device.type != "cuda" or self.device_bytes <= self.device_total:
            return
        parts = ", ".join(
            f"{p.label} {human_bytes(p.bytes)}" for p in self.parts if p.place == DEVICE and p.bytes
        )
        raise ValueError(
            f"this worker's parts on {self.device_name} take {human_bytes(self.device_bytes)} "
            f"({parts}), more than the GPU's {human_bytes(self.device_total)}: keep the big "
            "tables on the parameter server (--placement hybrid or --placement-of "
            "TABLE=hybrid) with a cache sized by --cache-memory F (a fraction of the GPU), "
            "a smaller --cache-rows/--cache-fraction, or shard them over more GPUs"
        )

    def describe(self) -> str:
        """The block a job prints at start: one line per part, then the device's total."""
        shown = [p for p in self.parts if p.bytes or p.key == "hybrid_tables"]
        width = max((len(p.label) for p in shown), default=0)
        lines = [f"memory of worker rank {self.rank} and its store:"]
        for p in shown:
            size = human_bytes(p.bytes)
            if p.key == "hybrid_tables" and self.dynamic_tables:
                size = f"{size} + dynamic" if p.bytes else "dynamic"
                note = "; ".join(filter(None, [p.notes, grows_with_use(self.dynamic_tables)]))
            else:
                note = p.notes
            lines.append(
                f"  {p.label:<{width}}  {size:>9}  {p.where}" + (f" ({note})" if note else "")
            )
        if self.device.type == "cuda":
            lines.append(
                f"  on {self.device_name}: {human_bytes(self.device_bytes)} of "
                f"{human_bytes(self.device_total)}"
            )
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """Plain ints and strings for the run's result: ``{"device", "device_total_bytes",
        "device_bytes", "host_bytes", "parts": {key: {"bytes", "where", "place"}},
        "dynamic_tables"}``; a part of table rows adds ``"weights_bytes"``,
        ``"state_bytes"``, ``"clock_bytes"`` and ``"dtypes"`` (its rows' types)."""
        parts: dict[str, dict[str, Any]] = {}
        for p in self.parts:
            part: dict[str, Any] = {"bytes": int(p.bytes), "where": p.where, "place": p.place}
            if p.tables is not None:
                part.update(
                    weights_bytes=int(p.tables.weights), state_bytes=int(p.tables.state),
                    clock_bytes=int(p.tables.clocks), dtypes=list(p.tables.dtypes),
                )  # fmt: skip
            parts[p.key] = part
        return {
            "device": str(self.device),
            "device_total_bytes": int(self.device_total),
            "device_bytes": int(self.device_bytes),
            "host_bytes": int(self.host_bytes),
            "parts": parts,
            "dynamic_tables": list(self.dynamic_tables),
        }


def grows_with_use(names: Sequence[str]) -> str:
    """``"cat0, cat1 grow with use"``; past three tables, their count."""
    if len(names) > 3:
        return f"{len(names)} dynamic tables grow with use"
    return f"{', '.join(names)} grow{'s' if len(names) == 1 else ''} with use"


def dense_bytes(module: nn.Module, state_per_parameter: float, state_shards: int = 1) -> int:
    """Weights, their gradients and ``state_per_parameter`` optimizer values per weight
    (Adam 2, Adagrad 1), the state split over ``state_shards`` ranks (ZeRO)."""
    weights = sum(p.numel() * p.element_size() for p in module.parameters())
    return int(2 * weights + math.ceil(weights * state_per_parameter / max(state_shards, 1)))


def plan_memory(
    tables: Sequence[TableConfig],
    *,
    device: torch.device,
    store_where: str,
    store_remote: bool,
    cache: CacheConfig | None,
    cache_on_device: bool,
    rank: int,
    world_size: int,
    dense: int,
    dense_note: str = "weights, gradients, optimizer state",
) -> MemoryPlan:
    """The plan of one worker: ``tables`` with their placements, the store they live in
    (``store_where``, e.g. ``"host (in-process store)"``; ``store_remote``: on
    other processes), the ``cache`` in front of the
    hybrid ones (rows on ``device`` when ``cache_on_device``), ``rank`` of the
    ``world_size`` ranks the sharded tables are split over, and ``dense`` bytes of the
    dense part (:func:`dense_bytes`)."""
    where = str(device)
    hybrid = [t.to_spec() for t in tables if t.placement == "hybrid"]
    local = [t.to_spec() for t in tables if t.placement == "local"]
    sharded = [t for t in tables if t.placement == "sharded"]
    store = TableBytes()
    dynamic = []
    for spec in hybrid:
        if spec.num_rows is not None:
            store = store.plus(spec, spec.num_rows)
        elif spec.capacity is not None:  # a dynamic table evicts past its capacity
            store = store.plus(spec, spec.capacity)
        else:
            dynamic.append(spec.name)
    parts = []
    if hybrid:
        parts.append(
            MemoryPart(
                "hybrid_tables",
                "hybrid tables",
                store.total,
                store_where,
                REMOTE if store_remote else HOST,
                tables=store,
            )
        )
    if cache is not None and hybrid:
        taken = cache_bytes(cache, hybrid, on_device=cache_on_device)
        if cache.capacity_fraction is not None:
            share = f"{cache.capacity_fraction:.1%} of each table's rows"
        else:
            share = f"{cache.capacity_rows} rows per table"
        if cache_on_device:
            parts.append(MemoryPart(
                "cache_device", "cache rows", taken.device, where, DEVICE,
                f"rows, pending sums: {share}",
            ))  # fmt: skip
            parts.append(MemoryPart(
                "cache_host", "cache index", taken.host, "host", HOST, "slots, id map, metadata"
            ))  # fmt: skip
        else:
            parts.append(MemoryPart("cache_host", "cache", taken.host, "host", HOST, share))
    if local:
        rows = TableBytes()
        for spec in local:
            rows = rows.plus(spec, spec.num_rows or 0)  # local tables are fixed
        parts.append(
            MemoryPart("local_tables", "local tables", rows.total, where, DEVICE, tables=rows)
        )
    if sharded:
        plan = ShardingPlan.build(sharded, world_size)
        rows = TableBytes()
        for cfg in sharded:
            start, stop = plan.table(cfg.name).rows_on(rank)
            rows = rows.plus(cfg.to_spec(), stop - start)
        note = f"rank {rank}'s shards of {world_size}" if world_size > 1 else "all shards"
        parts.append(MemoryPart(
            "sharded_tables", "sharded tables", rows.total, where, DEVICE, note, tables=rows
        ))  # fmt: skip
    parts.append(MemoryPart("dense", "dense", dense, where, DEVICE, dense_note))
    return MemoryPlan(
        device=device,
        device_total=device_memory(device),
        device_name=describe_where(device),
        parts=tuple(parts),
        dynamic_tables=tuple(dynamic),
        rank=rank,
    )


__all__ = [
    "MemoryPart",
    "MemoryPlan",
    "TableBytes",
    "cache_size_fitting",
    "dense_bytes",
    "device_memory",
    "human_bytes",
    "plan_memory",
    "row_bytes",
]
