"""ps: the parameter server. Tables of rows, server-side optimizers, per-row clocks.

Quick use::

    import torch
    import ps

    store = ps.InProcessStore()
    store.create_table(ps.TableSpec(name="items", num_rows=1000, dim=16,
                                    optimizer=ps.RowWiseAdagrad(lr=0.05)))
    ids = torch.tensor([3, 7, 3])
    got = store.pull("items", ids)          # got.rows [3, 16], got.clocks [3]
    store.push("items", ids, torch.ones(3, 16))  # id 3's two gradients are summed
    stale = store.pull("items", ids, clocks=got.clocks, bound=0)  # only rows that moved
    store.save("/tmp/ckpt")                 # see ps.checkpoint for the format
    store.create_table(store.spec("items"), exist_ok=True)  # equal spec: opened (shared
    store.drop_table("items")                                # stores: every worker calls it)

Layout (what every store shares at the top, one subpackage per kind of store)::

    ps/
      store.py        the Store interface: pull / push / lifecycle / checkpoints
      group_requests.py  requests over several tables as one id space (a shared cache's)
      errors.py       TableExistsError, TableSpecMismatch (create_table's outcomes)
      table.py        TableSpec, deterministic initial rows
      optimizers.py   SGD, RowWiseAdagrad, Adagrad, Adam, FTRL (applied by the store)
      routing.py      id -> shard (splitmix64)
      validate.py     request checks every store runs
      checkpoint.py   the on-disk format (JSON manifest + .npy parts, no pickle)
      kernels/        C kernels of the CPU row updates (rowwise_adagrad.c + loader)
      local/          tables in this process: LocalTable (the engine), InProcessStore
      mpi/            the MPI store: wire format, server loop (serve_mpi), worker store
      redis/          the Redis store: connections, Lua, key layout, eviction, snapshots

The protocol of the shared stores (messages, exactly-once pushes, table lifecycle,
liveness) is described in ``docs/ps_protocol.md``.

``MPIStore``, ``serve_mpi``, ``ServerConfig`` and ``RedisStore`` are imported on first
use: importing mpi4py starts MPI, and a laptop run needs neither.
"""

from typing import Any

from ps import checkpoint, routing
from ps.errors import TableExistsError, TableSpecMismatch
from ps.local.store import InProcessStore
from ps.optimizers import (
    FTRL,
    SGD,
    Adagrad,
    Adam,
    Optimizer,
    RowWiseAdagrad,
    optimizer_from_json,
)
from ps.routing import shard_of, splitmix64
from ps.store import (
    REQUEST_KEYS,
    STAT_KEYS,
    PullRequest,
    PullResult,
    PushRequest,
    Store,
    WriteRequest,
)
from ps.table import TableSpec, UniformInit, default_init

_LAZY = {
    "MPIStore": "ps.mpi.store",
    "serve_mpi": "ps.mpi.server",
    "ServerConfig": "ps.mpi.server",
    "RedisStore": "ps.redis.store",
    "RedisUnavailableError": "ps.redis.store",
    "RedisAuthError": "ps.redis.store",
    "RedisDataLossError": "ps.redis.store",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ps' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = [
    "MPIStore",
    "RedisAuthError",
    "RedisDataLossError",
    "RedisStore",
    "RedisUnavailableError",
    "ServerConfig",
    "serve_mpi",
    "FTRL",
    "SGD",
    "STAT_KEYS",
    "Adagrad",
    "Adam",
    "InProcessStore",
    "Optimizer",
    "PullRequest",
    "PullResult",
    "PushRequest",
    "WriteRequest",
    "REQUEST_KEYS",
    "RowWiseAdagrad",
    "Store",
    "TableExistsError",
    "TableSpec",
    "TableSpecMismatch",
    "UniformInit",
    "checkpoint",
    "default_init",
    "optimizer_from_json",
    "routing",
    "shard_of",
    "splitmix64",
]
