"""``--ps`` for the example jobs: which parameter server holds the embedding rows.

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

from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit, urlunsplit

import torch

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


def create_shared_tables(store: Store, specs: list[TableSpec], group: ProcessGroup) -> None:
    """Collective: create the tables of a store shared by the workers (MPI servers, Redis)
    from rank 0 only, before the workers build their embedding collections.

    Each collection creates the tables it misses; on a shared store two workers doing
    that at the same moment would race ("table already exists"). Rank 0 creates them
    first, the others wait; each collection then finds them and checks their specs.
    A per-rank (replicated) store needs nothing.
    """
    if group.size == 1 or store_is_replicated(store) or not specs:
        return
    error: Exception | None = None
    if group.rank == 0:
        try:
            have = set(store.tables())
            for spec in specs:
                if spec.name not in have:
                    store.create_table(spec)
        except Exception as e:  # raised on every rank below
            error = e
    flag = group.allreduce(torch.tensor([0 if error is None else 1]), op="max")
    if error is not None:
        raise error
    if int(flag):
        raise RuntimeError("creating the embedding tables in the shared store failed on rank 0")


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


__all__ = [
    "PSChoice",
    "PSRole",
    "open_ps",
    "parse_ps",
    "topology_for",
    "with_cache",
    "create_shared_tables",
]
