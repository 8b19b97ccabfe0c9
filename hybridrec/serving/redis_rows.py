"""An export's tables in Redis: :func:`load_into_redis` writes them once, and
:class:`RedisRows` pulls the rows a batch names for a :class:`Predictor` built with
``redis_url``.

Redis holds float32 rows (what a :class:`ps.RedisStore` pulls): fp16 and int8 exports
are decoded on load (:func:`hybridrec.serving.tables.decode`, the formula every path
reads with), so a Redis predictor scores as the in-memory predictor of the same export,
bit for bit: the same float32 rows, summed per bag in the same order. The tables are
``ps.RedisStore`` tables under ``prefix`` (default ``serving``) on a Redis server or a
Redis Cluster (``?cluster=1``, as ``--ps`` takes it: the rows spread over its masters by
bucket), with SGD as their optimizer (nothing pushes to them) and no eviction; a
dynamic table keeps its initial rows, so an id the run never trained pulls as its
initial row, as the files read it.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hybridrec.launch.roles import parse_ps
from hybridrec.serving.artefact import ExportReader
from hybridrec.serving.tables import ServingTable
from ps import SGD, PullRequest, TableSpec
from ps.checkpoint import TablePart, write_checkpoint
from ps.redact import redact_url

if TYPE_CHECKING:
    from hybridrec.serving.tables import TableGroup
    from ps.redis.store import RedisStore

PREFIX = "serving"
LOAD_ROWS = 1 << 20  # rows per checkpoint part written on the way into Redis


def serving_spec(table: ServingTable) -> TableSpec:
    """The Redis table of an export's table: its rows and dim, SGD (no state), no eviction;
    a dynamic table keeps its run's initial rows (the rows of ids never trained)."""
    plain = SGD(lr=1.0)
    if table.num_rows is not None:
        return TableSpec(name=table.name, num_rows=table.num_rows, dim=table.dim, optimizer=plain)
    assert table.spec is not None
    return dataclasses.replace(table.spec, optimizer=plain, capacity=None, max_age_steps=None)


def open_store(url: str, prefix: str) -> RedisStore:
    """The Redis at ``url`` as ``--ps`` names one: ``redis://`` or ``rediss://``, with
    ``?cluster=1`` for a Redis Cluster (any node's address)."""
    from ps.redis.store import RedisStore

    choice = parse_ps(url)
    if choice.kind != "redis":
        raise ValueError(f"serving from Redis: {redact_url(url)!r} is not a redis:// URL")
    return RedisStore(choice.url, prefix=prefix, cluster=choice.cluster)


def load_into_redis(
    folder: str | Path, url: str, *, prefix: str = PREFIX, verify: bool = True
) -> list[str]:
    """Write every table of the export ``folder`` into the Redis at ``url`` under
    ``prefix`` as float32 rows (tables of that name there are replaced); returns the
    table names. One table at a time goes through a temporary ps checkpoint
    (:meth:`ps.RedisStore.load`), so memory holds one table's float32 rows at most."""
    reader = ExportReader.open(folder, verify=verify)
    store = open_store(url, prefix)
    names = []
    try:
        for name, doc in reader.manifest["tables"].items():
            table = ServingTable.open(reader, name, doc)
            n = int(table.weight.shape[0])
            ids = torch.arange(n) if table.ids is None else torch.from_numpy(table.ids.copy())
            parts = (
                TablePart(
                    ids=ids[lo : lo + LOAD_ROWS],
                    weights=table.decoded(torch.arange(lo, min(n, lo + LOAD_ROWS))),  # [r, D]
                    state=torch.zeros(min(n, lo + LOAD_ROWS) - lo, 0),
                    clocks=torch.zeros(min(n, lo + LOAD_ROWS) - lo, dtype=torch.int64),
                )
                for lo in range(0, n, LOAD_ROWS)
            )
            with tempfile.TemporaryDirectory(prefix="hybridrec-serving-redis-") as tmp:
                path = Path(tmp) / "table"
                spec = serving_spec(table)
                write_checkpoint(path, [(spec, parts)], writer="hybridrec.serving.load_into_redis")
                store.load(path)
            names.append(name)
    finally:
        store.close()
    return names


class RedisRows:
    """The rows of a :class:`hybridrec.serving.tables.TableGroup`'s batch pulled from
    Redis: each feature's distinct ids, all features in one pipelined ``pull_many``."""

    def __init__(self, url: str, prefix: str, tables: Sequence[ServingTable]) -> None:
        self.where = redact_url(url)
        self.store = open_store(url, prefix)
        try:
            for t in tables:
                self._check(t, prefix)
        except BaseException:
            self.store.close()
            raise

    def _check(self, table: ServingTable, prefix: str) -> None:
        """ValueError unless Redis holds ``table`` with the export's rows and dim."""
        hint = (
            "load the export with hybridrec.serving.load_into_redis(MODEL_DIR, url, "
            f"prefix={prefix!r})"
        )
        if table.name not in self.store.tables():
            raise ValueError(
                f"Redis {self.where}: no table {table.name!r} under prefix {prefix!r}; {hint}"
            )
        spec = self.store.spec(table.name)
        if (spec.num_rows, spec.dim) != (table.num_rows, table.dim):
            raise ValueError(
                f"Redis {self.where}: table {table.name!r} has {spec.num_rows} rows of dim "
                f"{spec.dim}, the export {table.num_rows} of dim {table.dim}: another "
                f"model's tables under prefix {prefix!r}; {hint}"
            )

    def __call__(
        self, group: TableGroup, parts: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows [M, D], index [N])``: the distinct rows of every feature's ids
        (``parts``, one int64 tensor per feature of ``group``) and where each id's row is."""
        uniq, index, base = [], [], 0
        for ids in parts:
            u, inv = torch.unique(ids, return_inverse=True)  # [U_k], [n_k]
            uniq.append(u)
            index.append(inv + base)
            base += int(u.numel())
        requests = [PullRequest(f.table.name, u) for f, u in zip(group.features, uniq, strict=True)]
        results = self.store.pull_many(requests)
        rows = torch.cat([r.rows for r in results]) if results else torch.zeros(0, group.dim)
        return rows, torch.cat(index) if index else torch.zeros(0, dtype=torch.int64)

    def close(self) -> None:
        self.store.close()
