"""Launch roles of a job: the world, its workers and PS servers, the store of the rows.

:class:`Launch` is what a job's ``main()`` opens: it starts the world, checks the
roles, opens ``--ps`` (server ranks serve there) and always closes store and world.
The cache a job's hybrid tables get is :mod:`hybridrec.launch.job_cache`.

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

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import parse_qs, urlsplit, urlunsplit

import torch

import comm
from comm import ProcessGroup, Role, Topology
from hybridrec.launch.allocator import keep_freed_memory
from ps import InProcessStore, Store
from ps.redact import redact_url


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
            raise ValueError(f"--ps {redact_url(value)!r}: unknown query options {sorted(query)}")
        url = urlunsplit(parts._replace(query=""))
        return PSChoice("redis", url=url, cluster=cluster)
    raise ValueError(
        f"--ps {redact_url(value)!r}: expected 'local', 'mpi', 'mpi:<servers>' or a redis:// URL"
    )


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


def store_location(value: str, workers: int = 1) -> tuple[str, bool]:
    """Where ``--ps value`` keeps the hybrid tables, for the memory plan: ``(text,
    remote)``, e.g. ``("host (in-process store)", False)``, ``("2 PS server ranks",
    True)``; ``workers`` > 1 with ``local``: every worker holds its own replica."""
    choice = parse_ps(value)
    if choice.kind == "local":
        return "host (in-process store" + (", a replica per worker)" if workers > 1 else ")"), False
    if choice.kind == "mpi":
        n = choice.num_servers
        return f"{n} PS server rank{'s' if n != 1 else ''}", True
    return ("Redis Cluster" if choice.cluster else "Redis"), True


def describe_roles(topology: Topology, backend: str) -> str:
    """``"3 ranks: 2 workers + 1 PS server (mpi)"``: the job's header."""
    n, w, s = topology.world_size, topology.num_workers, topology.num_servers
    text = f"{n} rank{'s' if n != 1 else ''}: {w} worker{'s' if w != 1 else ''}"
    if s:
        text += f" + {s} PS server{'s' if s != 1 else ''}"
    return f"{text} ({backend})"


def describe_device(device: torch.device, precision: str) -> str:
    """``"workers on cuda:0 (NVIDIA H200, 139 GiB), bf16"``: the job's header."""
    where = str(device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        where += f" ({props.name}, {props.total_memory / 2**30:.0f} GiB)"
    return f"workers on {where}, {precision}"


def check_batch_size(batch_size: int, topology: Topology, ranks_per_replica: int = 1) -> None:
    """ValueError unless the global batch splits evenly over the model replicas: the
    worker ranks, or groups of ``ranks_per_replica`` of them that hold one model split
    over them and see the same samples (a mesh that does not divide is the job's error)."""
    workers = topology.num_workers
    if ranks_per_replica > 1:
        if workers % ranks_per_replica:
            return
        replicas = workers // ranks_per_replica
        if batch_size % replicas:
            raise ValueError(
                f"--batch-size {batch_size} must be a multiple of the {replicas} model replicas "
                f"({workers} worker ranks, {ranks_per_replica} per replica)"
            )
        return
    if batch_size % workers:
        raise ValueError(
            f"--batch-size {batch_size} must be a multiple of the {workers} worker "
            f"rank(s) ({topology.world_size} ranks, {topology.num_servers} of them parameter "
            "servers)"
        )


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch's intra-op thread count set to ``count`` (0: leave torch's default) for the
    block, and restored after it."""
    before = torch.get_num_threads()
    if count:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class LaunchOptions(Protocol):
    """What a job config tells :meth:`Launch.for_run` (both jobs' configs have these)."""

    backend: str
    ps: str
    batch_size: int
    validate_comm: bool
    threads: int
    keep_freed_mb: int

    @property
    def ranks_per_replica(self) -> int: ...


class Launch:
    """The process roles of one job, opened and always closed::

        with Launch.for_run(cfg) as job:  # or Launch(backend, ps=..., batch_size=...)
            if job.is_worker:  # server ranks served inside __enter__ and skip the body
                train(cfg, job.group, job.store, roles=job.topology)

    ``__enter__`` sets torch's thread count (``threads``, 0: torch's default) and
    the C library's allocator to keep freed memory (``keep_freed_mb``, 0: its defaults;
    :mod:`hybridrec.launch.allocator`), starts
    the world (``comm.init``), checks the roles against the job on
    every rank before anything starts (``--ps`` needs the right backend and enough
    ranks; the global batch splits over the model replicas), then opens ``--ps``: a PS server
    rank serves there until every worker closed its store. ``__exit__`` closes the
    store and the world, also after an error.
    """

    def __init__(
        self,
        backend: str = "auto",
        *,
        ps: str = "local",
        batch_size: int | None = None,
        ranks_per_replica: int = 1,
        validate: bool = False,
        timeout_s: float | None = None,
        threads: int = 0,
        keep_freed_mb: int = 0,
    ) -> None:
        parse_ps(ps)  # a bad --ps fails before any process group starts
        self.backend, self.ps, self.batch_size = backend, ps, batch_size
        self.ranks_per_replica = ranks_per_replica
        self.validate, self.timeout_s, self.threads = validate, timeout_s, threads
        self.keep_freed_mb = keep_freed_mb
        self._threads_before = torch.get_num_threads()
        self.world: ProcessGroup | None = None
        self.role: PSRole | None = None

    @classmethod
    def for_run(cls, cfg: LaunchOptions, *, training: bool = True) -> Launch:
        """The launch a job config asks for: its ``backend``, ``ps``, ``batch_size``,
        ``validate_comm``, ``threads``, ``keep_freed_mb`` and ``ranks_per_replica``
        (every job's config has them: :class:`hybridrec.cli.job_options.RunOptions` and
        the job's own fields).
        Not ``training`` (scoring a saved run): the training batch is not checked."""
        return cls(
            cfg.backend, ps=cfg.ps, batch_size=cfg.batch_size if training else None,
            ranks_per_replica=cfg.ranks_per_replica, validate=cfg.validate_comm,
            threads=cfg.threads, keep_freed_mb=cfg.keep_freed_mb,
        )  # fmt: skip

    def __enter__(self) -> Launch:
        if self.threads:  # torch threads per rank (restored on exit)
            torch.set_num_threads(self.threads)
        # process-wide and kept after exit: glibc has no way back to its dynamic defaults
        keep_freed_memory(self.keep_freed_mb)
        if self.timeout_s is None:
            self.world = comm.init(self.backend, validate=self.validate)
        else:
            self.world = comm.init(self.backend, validate=self.validate, timeout_s=self.timeout_s)
        try:
            topology = topology_for(self.ps, self.world)
            if self.batch_size is not None:
                check_batch_size(self.batch_size, topology, self.ranks_per_replica)
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
    "Launch",
    "PSChoice",
    "PSRole",
    "check_batch_size",
    "describe_device",
    "describe_roles",
    "open_ps",
    "parse_ps",
    "store_location",
    "topology_for",
    "torch_threads",
]
