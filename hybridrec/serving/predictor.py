"""``Predictor(MODEL_DIR)``: click probabilities from an export, without a process group
or any pickle.

Loading checks every file's size and sha256 against the manifest, reads the tables into
memory when they fit (else memory-maps the row files, optionally behind a hot-row cache;
or pulls rows from Redis) and rebuilds the dense part from its config and ``.npy``
weights. ``predict`` looks up and pools the fixed tables of one dim and row format
together, as the training model's fused local tables do (one gather and one
``embedding_bag`` for all their features, :class:`hybridrec.serving.tables.TableGroup`),
and runs the dense part::

    batch.sparse (K features, B samples) --one lookup + pool per group--> [K * B, D]
        --split per feature--> K x [B, D]
    batch.dense [B, num_dense] ---------------------------> DLRMDense -> logits [B] -> sigmoid
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from dense import DLRMConfig, DLRMDense
from embedding import KeyedJaggedIds
from hybridrec.datasets.ctr import Batch
from hybridrec.datasets.encode import Encoders, Row
from hybridrec.serving.artefact import ExportReader
from hybridrec.serving.redis_rows import PREFIX, RedisRows
from hybridrec.serving.tables import ServingTable, TableGroup


def available_memory() -> int:
    """Bytes of memory this machine can give without swapping (``MemAvailable``), or its
    physical memory where ``/proc/meminfo`` is not there."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


# A feature as the predictor serves it: (index in the dense part's order, name, table,
# pooling).
Entry = tuple[int, str, ServingTable, str]


class Predictor:
    """A loaded export. ``predict(batch)`` -> probabilities float32 ``[B]``.

    ``device``: where the dense part runs (rows are looked up on the host and moved in
    one copy per group). ``verify``: check every file's sha256 (the sizes are always
    checked); off, loading reads nothing of the row files but their headers.

    Where the rows are read from:

    * ``tables_in_memory=True``: every table's rows copied once into one tensor per
      group (stored dtype: fp16 and int8 stay compact); ``False``: the row files
      memory-mapped, so tables larger than memory serve from the page cache; ``None``
      (default): in memory when the row files fit ``memory_budget`` bytes (default half
      the memory available at load), else mapped.
    * ``hot_rows=N`` (mapped tables): a direct-mapped cache of N decoded rows per table
      (:class:`hybridrec.serving.tables.HotRows`); unused when the tables are in memory.
    * ``redis_url``: rows pulled from Redis under ``redis_prefix``, written there once by
      :func:`hybridrec.serving.load_into_redis` (float32; fp16 and int8 decoded on load).
    """

    def __init__(
        self,
        folder: str | Path,
        device: str | torch.device = "cpu",
        verify: bool = True,
        *,
        tables_in_memory: bool | None = None,
        memory_budget: int | None = None,
        hot_rows: int | None = None,
        redis_url: str | None = None,
        redis_prefix: str = PREFIX,
    ):
        self.reader = ExportReader.open(folder, verify=verify)
        m = self.reader.manifest
        if m.get("kind") != "dlrm":
            raise ValueError(f"{folder}: an export of a {m.get('kind')!r} model, not a DLRM")
        self.device = torch.device(device)
        self.manifest = m
        self.features: list[dict[str, Any]] = list(m["features"])  # the dense part's order
        self.feature_names = [f["name"] for f in self.features]
        self.tables = {
            name: ServingTable.open(self.reader, name, doc) for name, doc in m["tables"].items()
        }
        self.config = DLRMConfig(**m["dense_config"])
        self.dense = self._dense(m["dense_weights"])
        self.encoders = (
            Encoders.from_state(self.reader.json(m["encoders"])) if m.get("encoders") else None
        )
        self.redis: RedisRows | None = None
        if redis_url is not None:
            self.redis = RedisRows(redis_url, redis_prefix, list(self.tables.values()))
        plan, self.singles = self._plan()
        grouped = {t.name: t for feats in plan for _, _, t, _ in feats}
        need = sum(t.nbytes for t in grouped.values())
        if tables_in_memory is None:
            budget = available_memory() // 2 if memory_budget is None else memory_budget
            tables_in_memory = self.redis is None and need <= budget
        self.tables_in_memory = bool(tables_in_memory) and self.redis is None
        self.groups: list[TableGroup] = [
            TableGroup.build(
                feats,
                in_memory=self.tables_in_memory,
                hot_rows=hot_rows,
                source=self.redis,
            )
            for feats in plan
        ]

    def _plan(self) -> tuple[list[list[Entry]], list[Entry]]:
        """The features of each group (``(index, feature, table, pooling)`` lists, one per
        dim and row format: fixed tables pooled "sum" or "mean"; with Redis every table,
        by dim), and the features served one by one (dynamic tables read from files)."""
        groups: dict[tuple[int, str], list[Entry]] = {}
        singles: list[Entry] = []
        for i, f in enumerate(self.features):
            t = self.tables[f["table"]]
            entry = (i, f["name"], t, f["pooling"])
            if f["pooling"] in ("sum", "mean") and (t.num_rows is not None or self.redis):
                key = (t.dim, "fp32" if self.redis else t.dtype)
                groups.setdefault(key, []).append(entry)
            else:
                singles.append(entry)
        return list(groups.values()), singles

    def _dense(self, files: dict[str, str]) -> DLRMDense:
        """The dense part rebuilt from its config, its weights from the ``.npy`` files."""
        with torch.device("meta"):  # shapes only: the weights come from the files
            dense = DLRMDense(self.config)
        state = {k: torch.from_numpy(self.reader.array(f)) for k, f in files.items()}
        dense.load_state_dict(state, strict=True, assign=True)
        dense.requires_grad_(False)
        return dense.eval().to(self.device)

    @property
    def num_dense(self) -> int:
        return self.config.num_dense

    def table_bytes(self) -> int:
        """Bytes of every table's row files (what a row format changes)."""
        return sum(t.nbytes for t in self.tables.values())

    def cache_stats(self) -> dict[str, dict[str, int]]:
        """Hits, misses and slots of each table's hot-row cache (empty without one)."""
        out: dict[str, dict[str, int]] = {}
        for g in self.groups:
            out.update(g.cache_stats())
        return out

    def close(self) -> None:
        """Close the Redis connection (the only resource a predictor holds)."""
        if self.redis is not None:
            self.redis.close()

    # ------------------------------------------------------------ scoring

    def _check(self, sparse: KeyedJaggedIds, dense: torch.Tensor) -> None:
        if not isinstance(sparse, KeyedJaggedIds):
            raise TypeError(f"predict: sparse ids must be a KeyedJaggedIds, got {type(sparse)}")
        unknown = [k for k in sparse.keys if k not in self.feature_names]
        if unknown:
            raise ValueError(
                f"predict: unknown feature {unknown[0]!r}; this model's features are "
                f"{self.feature_names}"
            )
        missing = [f for f in self.feature_names if f not in sparse]
        if missing:
            raise ValueError(
                f"predict: the batch lacks the features {missing} (every one is needed)"
            )
        if not isinstance(dense, torch.Tensor) or dense.dtype != torch.float32:
            what = dense.dtype if isinstance(dense, torch.Tensor) else type(dense).__name__
            raise TypeError(f"predict: dense features must be a float32 tensor, got {what}")
        want = (sparse.batch_size, self.num_dense)
        if dense.dim() != 2 or tuple(dense.shape) != want:
            raise ValueError(
                f"predict: dense features must be [B, num_dense] = {list(want)} for this "
                f"batch of {sparse.batch_size}, got shape {tuple(dense.shape)}"
            )

    @torch.inference_mode()
    def logits(
        self, batch: Batch | KeyedJaggedIds, dense: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits float32 ``[B]`` of a :class:`Batch`, or of sparse ids and ``dense [B, n]``."""
        if isinstance(batch, Batch):
            sparse, dense = batch.sparse, batch.dense
        else:
            sparse = batch
            if dense is None:
                raise TypeError("predict: give a Batch, or sparse ids and dense features")
        self._check(sparse, dense)
        sparse = sparse.to("cpu")  # rows are looked up on the host
        b = sparse.batch_size
        pooled: list[torch.Tensor | None] = [None] * len(self.features)  # [B, D] each
        for g in self.groups:
            sub = sparse if g.names == sparse.keys else sparse.select(g.names)
            out = g.pool(sub)  # [K_g * B, D], feature-major
            # Contiguous [B, D] views, as the training forward splits its lookup.
            for f, part in zip(
                g.features, out.view(len(g.features), b, g.dim).unbind(0), strict=True
            ):
                pooled[f.index] = part
        for i, name, table, pooling in self.singles:
            bag = sparse.key_slice(name)
            table.check_ids(name, bag.ids)
            pooled[i] = table.pool(bag, pooling)
        parts = [p.to(self.device) for p in pooled if p is not None]
        return self.dense(dense.to(self.device), parts)

    def predict(
        self, batch: Batch | KeyedJaggedIds, dense: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Click probabilities float32 ``[B]`` (on ``device``)."""
        return torch.sigmoid(self.logits(batch, dense))

    def encode(self, rows: list[Row]) -> Batch:
        """Raw rows (label, dense numbers, each sparse column's values) encoded as the run
        encoded its data (:meth:`hybridrec.datasets.encode.Encoders.batch`)."""
        if self.encoders is None:
            raise ValueError(
                "predict_rows: this export has no data encoders (its run read a data set "
                "whose ids are made by its reader, e.g. synthetic); use predict"
            )
        names = [e.name for e in self.encoders.sparse]
        if sorted(names) != sorted(self.feature_names):
            raise ValueError(
                f"predict_rows: encoders for {names}, model features {self.feature_names}"
            )
        for i, row in enumerate(rows):
            if (
                len(row) != 3
                or len(row[1]) != len(self.encoders.dense)
                or len(row[2]) != len(names)
            ):
                raise ValueError(
                    f"predict_rows: row {i} must be (label, {len(self.encoders.dense)} dense "
                    f"numbers, {len(names)} sparse bags {names}), got {row!r}"[:400]
                )
        return self.encoders.batch(rows)

    def predict_rows(self, rows: list[Row]) -> torch.Tensor:
        """Probabilities ``[B]`` of raw tabular rows through the saved encoders."""
        return self.predict(self.encode(rows))
