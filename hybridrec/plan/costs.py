"""The calibration file: this machine's measured costs, as versioned JSON (no pickle).

Every cost is affine, ``alpha_s * count + beta_s * amount`` (:class:`Linear`): seconds
per call or message plus seconds per row, sample or byte. Layout of the file::

    {"schema": "hybridrec.plan.costs", "version": 2, "device": "cpu",
     "machine": {...}, "dim": 16,                      # row width the rows were timed at
     "data":      {"alpha_s", "beta_s"},                # batch assembly: per step, per sample
     "dense":     {"alpha_s", "s_per_param", "s_per_flop"},
     "embedding": {"local"|"hybrid"|"sharded": {"alpha_s", "per_lookup_s", "per_unique_s"}},
     "cache":     {"per_table_s", "per_id_s", "per_admit_s"},  # the cache's own work,
     "cache_shared": {...},                           # the same, not its tables' sole writer
     "server":    {"dense"|"sparse"|"mpi": {"pull", "pull_check", "push": {optimizer: ...}}},
     "mpi_wire":  {"pull", "pull_check", "push", "per_table_s", "messages_per_batch"},
     "mpi_wire_sharded": {...},                       # the same with two servers
     "collectives": {"allreduce"|"alltoallv"|"allgatherv": {"alpha_s", "beta_s"}},
     "sync_delay_s": 0.0005,                            # a wait for a descheduled rank
     "pipeline_overlap": 0.5}                           # share of the sparse step hidden

``server`` is the work of one PS shard (a :class:`ps.local.table.LocalTable`, what the
in-process store and each MPI server run): per table request and per row (``dense``: a
fixed table, held whole by one server or split densely by several; ``sparse``: a
dynamic table). ``mpi`` (with an MPI calibration) is an MPI server's own busy time on
one worker's batched request of fixed tables, which it serves whole in C
(:mod:`ps.mpi.batched_pass`; pushes: row-wise Adagrad only). ``mpi_wire`` is what the
MPI store adds on top of the servers' work (messages, copies), per message and per row
(and per table request); ``mpi_wire_sharded`` the same measured with two servers.
``messages_per_batch`` is the messages one server got for one ``pull_many`` of several
tables: 1 when the store batches, else the table count.
Collectives are at 2 ranks, per call and per byte sent. ``sync_delay_s`` is what each
round of a collective added at 3 ranks on fewer than 3 cores (0 on 3 cores or more):
the wait for a rank the scheduler had put aside. ``pipeline_overlap`` is the share of
the modelled overlap that the sparse pipeline achieved in the calibration's cached
steps (its thread's Python and the dense step's take turns on the interpreter lock).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

SCHEMA = "hybridrec.plan.costs"
VERSION = 3


@dataclass(frozen=True, slots=True)
class Linear:
    """``alpha_s * count + beta_s * amount`` seconds."""

    alpha_s: float
    beta_s: float

    def __call__(self, count: float, amount: float) -> float:
        return self.alpha_s * count + self.beta_s * amount


@dataclass(frozen=True, slots=True)
class DenseCosts:
    """Dense step: ``alpha_s + s_per_param * params`` (optimizer, launch) per step, plus
    ``s_per_flop * flops`` of forward + backward."""

    alpha_s: float
    s_per_param: float
    s_per_flop: float


@dataclass(frozen=True, slots=True)
class EmbeddingCosts:
    """A worker's own embedding work per step (no store, no exchange): ``alpha_s`` +
    ``per_lookup_s`` per id looked up (pooling forward and backward) + ``per_unique_s``
    per distinct id (dedup, gather, coalesced gradient)."""

    alpha_s: float
    per_lookup_s: float
    per_unique_s: float


@dataclass(frozen=True, slots=True)
class CacheCosts:
    """The cache's own work per table and step (a serving pull, a prefetch and a push):
    ``per_table_s`` + ``per_id_s`` per distinct id + ``per_admit_s`` per row fetched.
    Two sets are calibrated: a sole writer's (one worker: it asks the store only about
    misses and rows it pushed past the read bound) and a shared table's (several
    workers or other writers: every served id goes out with its copy's clock, and the
    rows others moved come back)."""

    per_table_s: float
    per_id_s: float
    per_admit_s: float

    def work(self, tables: Iterable[Any]) -> float:
        """Seconds of the cache's work per step for ``tables``' traffic (each with
        ``unique`` distinct ids and ``returned`` rows fetched, :class:`TableTraffic`)."""
        return sum(
            self.per_table_s + self.per_id_s * t.unique + self.per_admit_s * t.returned
            for t in tables
        )


@dataclass(frozen=True, slots=True)
class StoreCosts:
    """One request kind on one shard: ``pull`` (per table request, per row returned),
    ``pull_check`` (a conditional pull: per table request, per id asked, nothing
    returned), ``push`` per optimizer kind (per table request, per unique row)."""

    pull: Linear
    pull_check: Linear
    push: dict[str, Linear]

    def push_of(self, optimizer: str) -> Linear:
        if optimizer not in self.push:
            raise ValueError(
                f"costs: no push cost for optimizer {optimizer!r}; calibrated: "
                f"{sorted(self.push)} (calibrate with --optimizers ...)"
            )
        return self.push[optimizer]


@dataclass(frozen=True, slots=True)
class WireCosts:
    """What the MPI store adds to the shard's work: per message and per row (``pull``,
    ``pull_check``, ``push``), and per table request a message carries
    (``per_table_s``, by the same three kinds: splitting ids by server, packing)."""

    pull: Linear
    pull_check: Linear
    push: Linear
    per_table_s: dict[str, float]
    messages_per_batch: float


@dataclass(kw_only=True, slots=True)
class Costs:
    device: str
    machine: dict[str, Any]
    dim: int
    data: Linear
    dense: DenseCosts
    embedding: dict[str, EmbeddingCosts]
    cache: CacheCosts  # one worker, its tables' sole writer
    cache_shared: CacheCosts  # a cache that asks the store about every row it serves
    server: dict[str, StoreCosts]
    mpi_wire: WireCosts | None
    mpi_wire_sharded: WireCosts | None
    collectives: dict[str, Linear]
    sync_delay_s: float = 0.0
    pipeline_overlap: float = 1.0

    def row_scale(self, dim: int) -> float:
        """Per-row costs were timed at ``self.dim``: half of a row's cost is taken as
        fixed (indexing, bookkeeping), half as proportional to its width."""
        return 0.5 + 0.5 * dim / self.dim

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "version": VERSION, **asdict(self)}

    @staticmethod
    def from_json(data: Any, where: str = "costs") -> Costs:
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(data).__name__}")
        if data.get("schema") != SCHEMA:
            raise ValueError(
                f"{where}: not a planner calibration (schema {data.get('schema')!r}, "
                f"expected {SCHEMA!r}); make one with python -m hybridrec.plan --calibrate"
            )
        if data.get("version") != VERSION:
            raise ValueError(
                f"{where}: calibration version {data.get('version')!r}, this planner reads "
                f"version {VERSION}; calibrate again"
            )
        try:
            return Costs(
                device=str(data["device"]),
                machine=dict(data["machine"]),
                dim=int(data["dim"]),
                data=_linear(data["data"]),
                dense=DenseCosts(**_numbers(data["dense"], DenseCosts)),
                embedding={
                    k: EmbeddingCosts(**_numbers(v, EmbeddingCosts))
                    for k, v in data["embedding"].items()
                },
                cache=CacheCosts(**_numbers(data["cache"], CacheCosts)),
                cache_shared=CacheCosts(**_numbers(data["cache_shared"], CacheCosts)),
                server={k: _store(v) for k, v in data["server"].items()},
                mpi_wire=_wire(data["mpi_wire"]),
                mpi_wire_sharded=_wire(data["mpi_wire_sharded"]),
                collectives={k: _linear(v) for k, v in data["collectives"].items()},
                sync_delay_s=float(data["sync_delay_s"]),
                pipeline_overlap=_share(data["pipeline_overlap"]),
            )
        except KeyError as e:
            raise ValueError(f"{where}: missing key {e.args[0]!r}; calibrate again") from None
        except (TypeError, AttributeError) as e:
            raise ValueError(f"{where}: malformed calibration ({e}); calibrate again") from None


def _numbers(d: Any, cls: type) -> dict[str, float]:
    names = [f.name for f in fields(cls)]
    if not isinstance(d, dict) or sorted(d) != sorted(names):
        raise TypeError(f"{cls.__name__} needs exactly the keys {names}, got {d!r}")
    out = {}
    for k in names:
        v = d[k]
        if not isinstance(v, int | float) or isinstance(v, bool) or v < 0:
            raise TypeError(f"{cls.__name__}.{k} must be a number >= 0, got {v!r}")
        out[k] = float(v)
    return out


def _share(v: Any) -> float:
    if not isinstance(v, int | float) or isinstance(v, bool) or not 0.0 <= v <= 1.0:
        raise TypeError(f"pipeline_overlap must be a number in [0, 1], got {v!r}")
    return float(v)


def _linear(d: Any) -> Linear:
    return Linear(**_numbers(d, Linear))


def _wire(wire: Any) -> WireCosts | None:
    if wire is None:
        return None
    return WireCosts(
        pull=_linear(wire["pull"]),
        pull_check=_linear(wire["pull_check"]),
        push=_linear(wire["push"]),
        per_table_s={k: float(wire["per_table_s"][k]) for k in ("pull", "pull_check", "push")},
        messages_per_batch=float(wire["messages_per_batch"]),
    )


def _store(d: Any) -> StoreCosts:
    return StoreCosts(
        pull=_linear(d["pull"]),
        pull_check=_linear(d["pull_check"]),
        push={k: _linear(v) for k, v in d["push"].items()},
    )


def save_costs(costs: Costs, path: str | os.PathLike[str]) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(costs.to_json(), indent=1) + "\n", encoding="utf-8")
    return out


def load_costs(path: str | os.PathLike[str]) -> Costs:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(
            f"costs file {str(p)!r} not found; make one with "
            "python -m hybridrec.plan --calibrate --out costs.json"
        )
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"costs file {str(p)!r} is not JSON: {e}") from None
    return Costs.from_json(data, where=f"costs file {str(p)!r}")
