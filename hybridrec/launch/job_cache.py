"""The cache in front of a job's hybrid tables, from the job's options.

:func:`with_cache` builds the :class:`cache.CachedStore` that ``--cache-rows``,
``--cache-fraction`` or ``--cache-memory`` ask for (:func:`cache_config` says what it
will be, :func:`cache_device` where its rows live); :func:`wants_sparse_pipeline`
decides ``--sparse-pipeline auto``; :func:`job_memory_plan` is the memory plan of a job's
tables with that cache; :func:`init_rows_on` lets a GPU worker hash its in-process
tables' first rows on the GPU; :func:`row_optimizer` and :func:`with_row_dtypes` are what
``--emb-optimizer`` and ``--emb-dtype`` / ``--emb-dtype-of`` make of a job's tables.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

import comm
import ps
from cache import CacheConfig, CachedStore
from comm import ProcessGroup
from embedding import EmbeddingCollection, TableConfig
from embedding.hybrid import store_is_replicated
from hybridrec.cli.job_options import RunOptions
from hybridrec.launch.memory_plan import MemoryPlan, cache_size_fitting, device_memory, plan_memory
from hybridrec.launch.roles import store_location
from ps import InProcessStore, Store, TableSpec


def cache_device(cfg: RunOptions, device: torch.device) -> torch.device | None:
    """Where the cache keeps its rows (``cfg.cache_on``): the worker's GPU, or None for
    records in host memory. On a CPU worker always None (the host cache, as ever);
    ``--cache-on device`` there is an error."""
    if device.type != "cuda":
        if cfg.cache_on == "device":
            raise ValueError(
                f"--cache-on device keeps the cache's rows on the worker's GPU, but this worker "
                f"trains on {device} (use --cache-on auto or host, or --device cuda)"
            )
        return None
    return None if cfg.cache_on == "host" else device


def cache_config(
    cfg: RunOptions, specs: Sequence[TableSpec], device: torch.device
) -> CacheConfig | None:
    """The cache ``cfg`` asks for in front of the hybrid tables ``specs`` on a worker on
    ``device``; None without one. ``cfg``: a job config with the fields of
    :class:`hybridrec.cli.job_options.RunOptions` (``cache_rows``, ``cache_fraction``,
    ``cache_memory``, ``cache_on``, ``cache_policy``, ``read_bound``, ``write_bound``,
    ``counted_pushes``, ``local_step``, ``cache_groups``, ``cache_prefetch``,
    ``cache_write_back``).
    ``--cache-memory F`` sizes the
    cache's rows on the GPU to at most ``F`` of its memory
    (:func:`hybridrec.launch.memory_plan.cache_size_fitting`)."""
    if not cfg.wants_cache:
        return None
    on = cache_device(cfg, device)
    if cfg.cache_memory:
        if on is None:
            raise ValueError(
                f"--cache-memory {cfg.cache_memory} sizes a cache whose rows are on the GPU, "
                f"but this worker trains on {device} (size a host cache with --cache-rows or "
                "--cache-fraction)"
            )
        budget = int(cfg.cache_memory * device_memory(on))
        bounds = CacheConfig(
            capacity_rows=1,
            write_bound=cfg.write_bound,
            counted_pushes=cfg.counted_pushes,
            local_step=cfg.local_step,
        )  # what decides the bytes per cached row besides its width
        size: dict[str, Any] = cache_size_fitting(specs, budget, bounds)
    else:
        size = {
            "capacity_rows": cfg.cache_rows or None,
            "capacity_fraction": cfg.cache_fraction or None,
        }
    return CacheConfig(
        **size,
        policy=cfg.cache_policy,
        read_bound=cfg.read_bound,
        write_bound=cfg.write_bound,
        counted_pushes=cfg.counted_pushes,
        local_step=cfg.local_step,
        group_tables=cfg.cache_groups,
        prefetch=cfg.cache_prefetch,
        write_back=cfg.cache_write_back,
    )


def with_cache(
    cfg: RunOptions,
    store: Store,
    group: ProcessGroup,
    device: torch.device,
    *,
    specs: Sequence[TableSpec] = (),
) -> CachedStore | None:
    """The hot-row cache in front of ``store`` when ``cfg`` asks for one
    (:func:`cache_config`; ``specs``, the hybrid tables it will serve, size a
    ``--cache-memory`` cache); None otherwise. On a GPU worker (``device``) its rows
    are on the GPU unless ``--cache-on host``; on a CPU worker it is the host cache."""
    config = cache_config(cfg, specs, device)
    if config is None:
        return None
    if group.size > 1 and store_is_replicated(store):
        raise ValueError(
            f"the embedding cache needs one store shared by all ranks; with --ps local and "
            f"{group.size} ranks each would cache its own replica (use --ps mpi or redis://, "
            "or one rank)"
        )
    # One worker is its tables' only writer (unless other processes write them too): rows
    # it provably holds fresh (pushed at most read_bound times since their read) cost no
    # request (CacheConfig.sole_writer).
    config = dataclasses.replace(config, sole_writer=group.size == 1 and not cfg.other_writers)
    # device None: the host cache, the CPU path unchanged
    return CachedStore(store, config, device=cache_device(cfg, device))


def wants_sparse_pipeline(
    cfg: RunOptions, embeddings: EmbeddingCollection, device: torch.device
) -> bool:
    """Whether ``--sparse-pipeline`` (``cfg.sparse_pipeline``) turns the pipelined
    sparse step on for ``embeddings``. auto: hybrid tables over a store the ranks share
    (or one rank), and a core free to run it beside the dense step -- a GPU worker (the
    dense step runs on the GPU), or more cores than this host's ranks take for their torch
    threads. Measured on 2 cores (``docs/embedding.md``): with both cores computing the
    dense step, the thread only slows it; with one free, the sparse step hides behind it."""
    hybrid = embeddings.hybrid
    if hybrid is None or cfg.sparse_pipeline == "off":
        return False
    if cfg.sparse_pipeline == "on":
        return True  # set_sparse_pipeline refuses per-rank replicas, saying why
    if hybrid.group.size > 1 and not hybrid.store_is_shared:
        return False
    if device.type == "cuda":
        return True
    return comm.usable_cores() > comm.detect_launch().local_size * torch.get_num_threads()


def job_memory_plan(
    cfg: RunOptions,
    ps: str,
    tables: Sequence[TableConfig],
    device: torch.device,
    *,
    workers: int,
    rank: int,
    world_size: int,
    dense: int,
    dense_note: str,
) -> MemoryPlan:
    """Where a job's worker keeps its memory (:func:`hybridrec.launch.memory_plan.plan_memory`):
    ``tables`` by placement, the hybrid ones in the store ``ps`` (the job's ``--ps``) of
    ``workers`` and behind the cache ``cfg`` asks for (:func:`cache_config`), ``rank`` of the
    ``world_size`` ranks the sharded ones are split over, and ``dense`` bytes."""
    hybrid = [t.to_spec() for t in tables if t.placement == "hybrid"]
    where, remote = store_location(ps, workers)
    return plan_memory(
        tables, device=device, store_where=where, store_remote=remote,
        cache=cache_config(cfg, hybrid, device) if hybrid else None,
        cache_on_device=cache_device(cfg, device) is not None, rank=rank,
        world_size=world_size, dense=dense, dense_note=dense_note,
    )  # fmt: skip


def init_rows_on(store: Store, device: torch.device) -> None:
    """A GPU worker's in-process store hashes the initial rows of the tables it creates
    on that GPU (:class:`ps.InProcessStore` ``init_device``: the same bits as on the
    host, minutes sooner for tables of millions of rows); the rows stay in host memory.
    Any other store, a store already given a device, or a CPU worker: unchanged."""
    if device.type == "cuda" and isinstance(store, InProcessStore) and store.init_device is None:
        store.init_device = device


def row_optimizer(name: str, lr: float) -> ps.Optimizer:
    """A job's ``--emb-optimizer NAME`` at ``--emb-lr`` as the ps optimizer its tables
    apply to touched rows: adam, adagrad (row-wise) or sgd."""
    if name == "adam":
        return ps.Adam(lr=lr)
    if name == "adagrad":
        return ps.RowWiseAdagrad(lr=lr)
    if name == "sgd":
        return ps.SGD(lr=lr)
    raise ValueError(f"emb_optimizer must be adam, adagrad or sgd, got {name!r}")


def with_row_dtypes(cfg: RunOptions, tables: Sequence[TableConfig]) -> list[TableConfig]:
    """``tables`` with the row dtype ``--emb-dtype`` / ``--emb-dtype-of`` give each
    (:meth:`RunOptions.table_dtypes`: ValueError naming an override of a table the job
    does not have)."""
    dtypes = cfg.table_dtypes([t.name for t in tables])
    return [dataclasses.replace(t, dtype=dtypes[t.name]) for t in tables]
