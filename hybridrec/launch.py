"""Launch roles of a job: the world, its workers and PS servers, the store of the rows.

:class:`Launch` is what a job's ``main()`` opens: it starts the world, checks the
roles, opens ``--ps`` (server ranks serve there) and always closes store and world.
:func:`prepare_tables` readies the hybrid tables in a store that may outlive the job.

``--ps`` says which parameter server holds the embedding rows:

* ``local``: an in-process store in every worker (each holds a full replica and
  the collection keeps replicas equal). The default, no servers.
* ``mpi`` or ``mpi:S``: the last ``S`` ranks of the job (default 1) become
  parameter-server ranks and serve until the workers close the store; the other
  ranks train. Needs ``mpirun`` and the MPI backend.
* ``redis://[user:password@]host:port/db`` (``rediss://`` for TLS; add
  ``?cluster=1`` for Redis Cluster): a shared store on Redis.

:func:`open_ps` decides the roles once, from one :class:`comm.Topology`, and
checks it against the job before anything starts, so a bad ``--ps`` fails on
every rank with the numbers in the message.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit, urlunsplit

import torch

import comm
from cache import CacheConfig, CachedStore
from comm import ProcessGroup, Role, Topology
from embedding.hybrid import store_is_replicated
from ps import InProcessStore, Store, TableSpec


@dataclass(frozen=True, slots=True)
class PSChoice:
    """A parsed ``--ps`` value."""

    kind: str  # "local", "mpi" or "redis"
    num_servers: int = 0
    url: str = ""
    cluster: bool = False


def parse_ps(value: str) -> PSChoice:
    """``"local" | "mpi[:S]" | "redis://..."`` -> :class:`PSChoice` (ValueError otherwise)."""
    if value == "local":
        return PSChoice("local")
    if value == "mpi" or value.startswith("mpi:"):
        count = value.partition(":")[2] or "1"
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"--ps {value!r}: the server count after 'mpi:' must be >= 1")
        return PSChoice("mpi", num_servers=int(count))
    if value.startswith(("redis://", "rediss://")):
        parts = urlsplit(value)
        query = parse_qs(parts.query)
        cluster = query.pop("cluster", ["0"])[-1].lower() in ("1", "true", "yes")
        if query:
            raise ValueError(f"--ps {value!r}: unknown query options {sorted(query)}")
        url = urlunsplit(parts._replace(query=""))
        return PSChoice("redis", url=url, cluster=cluster)
    raise ValueError(f"--ps {value!r}: expected 'local', 'mpi', 'mpi:<servers>' or a redis:// URL")


@dataclass(slots=True)
class PSRole:
    """What this rank does: train (``store`` and the workers' ``group``) or serve."""

    topology: Topology
    role: Role
    group: ProcessGroup  # the workers' group on workers (all ranks without servers)
    store: Store | None  # None on server ranks


def topology_for(value: str, group: ProcessGroup) -> Topology:
    """The job's roles for ``--ps value`` (no communication): every rank computes the same
    one, so a job that cannot work fails on every rank before anything starts."""
    choice = parse_ps(value)
    if choice.kind != "mpi":
        return Topology.of(group)
    if group.backend != "mpi":
        raise ValueError(
            f"--ps mpi needs the MPI backend (run under mpirun); this job uses {group.backend!r}"
        )
    if group.size <= choice.num_servers:
        raise ValueError(
            f"--ps mpi:{choice.num_servers} needs more than {choice.num_servers} ranks "
            f"(at least one worker), but the job has {group.size}; run mpirun -n "
            f"{choice.num_servers + 1} or more"
        )
    return Topology.of(group, num_servers=choice.num_servers)


def open_ps(value: str, group: ProcessGroup) -> PSRole:
    """Parse ``--ps``, split the job into workers and servers (collective), open the store.

    On a server rank this *serves* (blocks until every worker closed its store)
    and then returns with ``store`` None: the caller just exits.
    """
    choice = parse_ps(value)
    topo = topology_for(value, group)
    if choice.kind != "mpi":
        if choice.kind == "local":
            return PSRole(topo, Role.WORKER, group, InProcessStore())
        from ps import RedisStore  # redis is only imported when asked for

        store = RedisStore(choice.url, cluster=choice.cluster)
        return PSRole(topo, Role.WORKER, group, store)
    role = topo.role(group.rank)
    workers = topo.role_group(group)  # collective on every rank, servers included
    if role is Role.SERVER:
        from ps import serve_mpi

        serve_mpi(group, topo)
        return PSRole(topo, role, workers, None)
    from ps import MPIStore

    return PSRole(topo, role, workers, MPIStore(group, topo))


EXISTING_TABLES = ("fail", "reuse", "replace")


class ExistingTablesError(ValueError):
    """A fresh job found its tables already in a shared store (an earlier run's rows)."""


def _shape(spec: TableSpec) -> str:
    rows = "dynamic" if spec.num_rows is None else str(spec.num_rows)
    return f"{rows} x {spec.dim}"


def _differences(have: TableSpec, want: TableSpec) -> str:
    """``rows x dim`` of both, and the other fields that differ, by name."""
    fields = [
        f"{name} {getattr(have, name)!r} vs {getattr(want, name)!r}"
        for name in ("optimizer", "init", "capacity", "max_age_steps", "nan_policy")
        if getattr(have, name) != getattr(want, name)
    ]
    text = f"the store has {_shape(have)} (rows x dim), this job needs {_shape(want)}"
    return text + (f"; {', '.join(fields)}" if fields else "")


def _check_tables(store: Store, specs: list[TableSpec], policy: str) -> list[str]:
    """Apply ``policy`` to the tables of ``specs`` that ``store`` already holds and create
    the missing ones; returns the names of the tables kept from an earlier run."""
    have = set(store.tables())
    found = [s for s in specs if s.name in have]
    if found and policy == "fail":
        names = ", ".join(repr(s.name) for s in found[:4])
        names += f" and {len(found) - 4} more" if len(found) > 4 else ""
        raise ExistingTablesError(
            f"the parameter-server store already holds table(s) {names}, probably from an "
            "earlier run; this job would train on from their rows. Pass --resume to continue "
            "that run from its checkpoint, --existing-tables reuse to train on from the rows "
            "in the store, or --existing-tables replace to drop them and start fresh"
        )
    kept = []
    for spec in found:
        old = store.spec(spec.name)
        if policy == "replace":
            drop = getattr(store, "drop_table", None)
            if drop is None:
                raise ValueError(
                    f"--existing-tables replace: {type(store).__name__} cannot drop table "
                    f"{spec.name!r}; clear the store by hand"
                )
            drop(spec.name)
        elif old != spec:
            raise ValueError(
                f"table {spec.name!r} is already in the parameter-server store with another "
                f"spec: {_differences(old, spec)}. Run with the options that made it, or clear "
                f"it: --existing-tables replace drops it (or FLUSHDB on a Redis store)"
            )
        else:
            kept.append(spec.name)
    for spec in specs:
        if spec.name not in kept:
            store.create_table(spec)
    return kept


def prepare_tables(
    store: Store, specs: list[TableSpec], group: ProcessGroup, policy: str = "reuse"
) -> list[str]:
    """Collective over the workers: make the hybrid tables ``specs`` ready in ``store``
    before the workers build their embedding collections; returns the names of the
    tables that were already there and are reused.

    ``policy`` says what to do with a table the store already holds (a shared store
    such as Redis outlives a job): ``fail`` (ValueError naming them and the options),
    ``reuse`` (keep its rows; a different spec is a ValueError naming the table and
    both shapes) or ``replace`` (drop and create it afresh). A shared store is
    checked and filled by rank 0 alone while the others wait (two workers creating
    the same table at once would race); a per-rank (replicated) store by every rank.
    Every rank raises the same error if it fails.
    """
    if policy not in EXISTING_TABLES:
        raise ValueError(f"policy must be one of {', '.join(EXISTING_TABLES)}, got {policy!r}")
    if not specs:
        return []
    if group.size == 1 or store_is_replicated(store):  # every rank checks its own copy
        return _on_every_rank(lambda: _check_tables(store, specs, policy), group)
    # A shared store: rank 0 decides; its answer (kept names or its error) goes to all.
    answer = ""
    if group.rank == 0:
        try:
            answer = "ok\n" + ",".join(_check_tables(store, specs, policy))
        except Exception as e:
            answer = f"{type(e).__name__}\n{e}"
    kind, _, text = _from_rank0(answer, group).partition("\n")
    if kind == "ok":
        return [n for n in text.split(",") if n]
    raise (ExistingTablesError if kind == "ExistingTablesError" else ValueError)(text)


def _from_rank0(text: str, group: ProcessGroup) -> str:
    """Collective: rank 0's ``text`` on every rank (one allgatherv of its UTF-8 bytes)."""
    mine = list(text.encode()) if group.rank == 0 else []
    return bytes(group.allgatherv(torch.tensor(mine, dtype=torch.uint8)).tolist()).decode()


def _on_every_rank(work: Callable[[], list[str]], group: ProcessGroup) -> list[str]:
    """Collective: run ``work`` on every rank; if it fails on any, raise on every rank."""
    error: Exception | None = None
    out: list[str] = []
    try:
        out = work()
    except Exception as e:
        error = e
    failed = torch.tensor([0 if error is None else 1], dtype=torch.int64)
    if group.size > 1:
        group.allreduce(failed, op="max")
    if error is not None:
        raise error
    if int(failed):
        raise RuntimeError("preparing the embedding tables failed on another rank (see its error)")
    return out


def create_shared_tables(store: Store, specs: list[TableSpec], group: ProcessGroup) -> None:
    """Collective: create the tables of a store shared by the workers (MPI servers, Redis)
    from rank 0 only, before the workers build their embedding collections; tables the
    store already holds with the same spec are kept (:func:`prepare_tables` with
    ``reuse``)."""
    prepare_tables(store, specs, group, "reuse")


def with_cache(cfg: Any, store: Store, group: ProcessGroup) -> CachedStore | None:
    """The hot-row cache in front of ``store`` when ``cfg`` (a job config with fields
    ``cache_rows``, ``cache_fraction``, ``cache_policy``, ``read_bound``, ``write_bound``)
    asks for one; None otherwise."""
    if not (cfg.cache_rows or cfg.cache_fraction):
        return None
    if group.size > 1 and store_is_replicated(store):
        raise ValueError(
            f"the embedding cache needs one store shared by all ranks; with --ps local and "
            f"{group.size} ranks each would cache its own replica (use --ps mpi or redis://, "
            "or one rank)"
        )
    return CachedStore(
        store,
        CacheConfig(
            capacity_rows=cfg.cache_rows or None,
            capacity_fraction=cfg.cache_fraction or None,
            policy=cfg.cache_policy,
            read_bound=cfg.read_bound,
            write_bound=cfg.write_bound,
        ),
    )


def describe_roles(topology: Topology, backend: str) -> str:
    """``"3 ranks: 2 workers + 1 PS server (mpi)"``: the job's header."""
    n, w, s = topology.world_size, topology.num_workers, topology.num_servers
    text = f"{n} rank{'s' if n != 1 else ''}: {w} worker{'s' if w != 1 else ''}"
    if s:
        text += f" + {s} PS server{'s' if s != 1 else ''}"
    return f"{text} ({backend})"


def check_batch_size(batch_size: int, topology: Topology) -> None:
    """ValueError unless the global batch splits evenly over the worker ranks."""
    if batch_size % topology.num_workers:
        raise ValueError(
            f"batch_size {batch_size} must be a multiple of the {topology.num_workers} worker "
            f"rank(s) ({topology.world_size} ranks, {topology.num_servers} of them parameter "
            "servers)"
        )


class Launch:
    """The process roles of one job, opened and always closed::

        with Launch(cfg.backend, ps=cfg.ps, batch_size=cfg.batch_size) as job:
            if job.is_worker:  # server ranks served inside __enter__ and skip the body
                train(cfg, job.group, job.store, roles=job.topology)

    ``__enter__`` sets torch's thread count (``threads``, 0: torch's default), starts
    the world (``comm.init``), checks the roles against the job on
    every rank before anything starts (``--ps`` needs the right backend and enough
    ranks; the global batch splits over the workers), then opens ``--ps``: a PS server
    rank serves there until every worker closed its store. ``__exit__`` closes the
    store and the world, also after an error.
    """

    def __init__(
        self,
        backend: str = "auto",
        *,
        ps: str = "local",
        batch_size: int | None = None,
        validate: bool = False,
        timeout_s: float | None = None,
        threads: int = 0,
    ) -> None:
        parse_ps(ps)  # a bad --ps fails before any process group starts
        self.backend, self.ps, self.batch_size = backend, ps, batch_size
        self.validate, self.timeout_s, self.threads = validate, timeout_s, threads
        self._threads_before = torch.get_num_threads()
        self.world: ProcessGroup | None = None
        self.role: PSRole | None = None

    def __enter__(self) -> Launch:
        if self.threads:  # torch threads per rank (restored on exit)
            torch.set_num_threads(self.threads)
        if self.timeout_s is None:
            self.world = comm.init(self.backend, validate=self.validate)
        else:
            self.world = comm.init(self.backend, validate=self.validate, timeout_s=self.timeout_s)
        try:
            topology = topology_for(self.ps, self.world)
            if self.batch_size is not None:
                check_batch_size(self.batch_size, topology)
            self.role = open_ps(self.ps, self.world)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the store, then the world (idempotent)."""
        try:
            if self.role is not None and self.role.store is not None:
                self.role.store.close()
        finally:
            self.role = None
            if self.world is not None:
                world, self.world = self.world, None
                world.close()
            torch.set_num_threads(self._threads_before)

    def _opened(self) -> PSRole:
        if self.role is None:
            raise RuntimeError("Launch: use it as a context manager (with Launch(...) as job)")
        return self.role

    @property
    def is_worker(self) -> bool:
        return self._opened().role is Role.WORKER

    @property
    def group(self) -> ProcessGroup:
        """The workers' group (every rank of the job without PS servers)."""
        return self._opened().group

    @property
    def store(self) -> Store:
        store = self._opened().store
        if store is None:
            raise RuntimeError("Launch.store: a PS server rank has no store (check is_worker)")
        return store

    @property
    def topology(self) -> Topology:
        return self._opened().topology

    def describe(self) -> str:
        assert self.world is not None
        return describe_roles(self.topology, self.world.backend)


__all__ = [
    "EXISTING_TABLES",
    "ExistingTablesError",
    "Launch",
    "PSChoice",
    "PSRole",
    "open_ps",
    "parse_ps",
    "topology_for",
    "with_cache",
    "check_batch_size",
    "create_shared_tables",
    "describe_roles",
    "prepare_tables",
]
