"""Where the DLRM job's batches come from: in-memory data sets or streamed files.

Both sources give this rank's slice of every *global* batch (``batch_size`` samples
split evenly over the worker ranks), so 1 rank and N ranks train on the same
global batches, and both can restart at a saved position:

* :class:`InMemorySource` (MovieLens-100k, a RecBole atomic data set, synthetic):
  every rank holds the whole data set; epoch ``e`` is one seeded shuffle,
  identical on every rank; rank ``r`` takes rows ``[r*b, (r+1)*b)`` of each global
  batch. Position: (epoch, step in the epoch); no per-rank state.
* :class:`StreamSource` (:class:`CriteoSource`, :class:`TabularSource`): the files
  are streamed, line ``i`` going to rank ``i mod n``; a rank's ``k``-th batch of
  ``b`` lines is its part of the global batch of lines ``[k*B, (k+1)*B)``. A final
  batch smaller than ``b`` is dropped (ranks would disagree on it). Position: each
  rank's :class:`ReaderPosition`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from comm import ProcessGroup
from hybridrec.datasets.criteo import (
    CAT_NAMES,
    NUM_INT,
    CriteoConfig,
    CriteoReader,
    criteo_encoders,
)
from hybridrec.datasets.ctr import Batch, CTRData, gather_batch
from hybridrec.datasets.encode import Encoders, VocabEncoder
from hybridrec.datasets.movielens import MOVIELENS_SCHEMA, read_movielens
from hybridrec.datasets.recbole import read_recbole
from hybridrec.datasets.schema import Schema, load_schema, schema_from_dict
from hybridrec.datasets.stream import ReaderPosition
from hybridrec.datasets.synthetic import make_synthetic
from hybridrec.datasets.tabular import TabularConfig, TabularFit, TabularReader, fit_tabular
from hybridrec.dlrm.config import DLRMJobConfig
from hybridrec.train.click_metrics import log_loss, popularity_scores, roc_auc


@dataclass(frozen=True, slots=True)
class Feature:
    """One sparse feature = one table: ``num_rows`` None for a dynamic table."""

    name: str
    num_rows: int | None
    multi: bool = False  # several ids per sample: mean pooling, else sum


def per_rank_batch(cfg: DLRMJobConfig, group: ProcessGroup) -> int:
    if cfg.batch_size % group.size != 0:
        raise ValueError(
            f"--batch-size {cfg.batch_size} must be a multiple of the number of worker ranks "
            f"{group.size} (each rank takes an equal slice of a global batch)"
        )
    return cfg.batch_size // group.size


class InMemorySource:
    """MovieLens-100k or the synthetic data set, held whole by every rank."""

    def __init__(
        self,
        data: CTRData,
        cfg: DLRMJobConfig,
        group: ProcessGroup,
        encoders: Encoders | None = None,
    ) -> None:
        self.data, self.cfg, self.group = data, cfg, group
        self.encoders = encoders  # those that built ``data`` (RecBole, MovieLens); None: synthetic
        self.per_rank = per_rank_batch(cfg, group)
        self.features = [Feature(f.name, f.num_rows, multi=f.ids.shape[1] > 1) for f in data.sparse]
        self.num_dense = len(data.dense_names)

    def describe(self) -> str:
        d = self.data
        return (
            f"{self.cfg.data}: {d.num_samples} samples ({len(d.train_idx)} train), "
            f"{len(d.sparse)} sparse + {len(d.dense_names)} dense features"
        )

    @property
    def steps_per_epoch(self) -> int:
        return len(self.data.train_idx) // self.cfg.batch_size  # the last partial batch dropped

    def local_batches(self, epoch: int) -> list[torch.Tensor]:
        """This rank's sample indices ``[b]`` of each full global batch of ``epoch``."""
        cfg, g = self.cfg, self.group
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch)
        order = self.data.train_idx[torch.randperm(len(self.data.train_idx), generator=gen)]
        start = g.rank * self.per_rank
        return [
            order[s * cfg.batch_size + start : s * cfg.batch_size + start + self.per_rank]
            for s in range(self.steps_per_epoch)
        ]

    def train_batches(
        self, epoch: int, skip: int = 0, start: torch.Tensor | None = None
    ) -> Iterator[tuple[Batch, torch.Tensor]]:
        """``(batch, position)`` from step ``skip`` of ``epoch`` on; no per-rank position."""
        del start
        for idx in self.local_batches(epoch)[skip:]:
            yield gather_batch(self.data, idx), torch.empty(0, dtype=torch.int64)

    def eval_batches(self, split: str) -> Iterator[Batch]:
        """This rank's share of ``split`` ("val" or "test"), in as many batches as every
        other rank's (a sharded table needs every rank in each forward)."""
        idx = self.data.val_idx if split == "val" else self.data.test_idx
        shard = torch.tensor_split(idx, self.group.size)[self.group.rank]
        longest = -(-len(idx) // self.group.size)
        count = max(1, -(-longest // self.cfg.eval_batch_size))
        for part in torch.tensor_split(shard, count):
            yield gather_batch(self.data, part)

    def has_split(self, split: str) -> bool:
        return True

    def encoder_state(self) -> dict[str, Any] | None:
        """What a checkpoint keeps to encode new data: the RecBole (MovieLens) encoders,
        so that other files encode as this run's did (the split comes from the seed);
        nothing for the synthetic data."""
        return None if self.encoders is None else self.encoders.to_state()

    def value_names(self, feature: str) -> list[str] | None:
        return value_names(self.encoders, feature)

    def baseline(self) -> tuple[float, float] | None:
        """AUC and log loss on the test split of each item's smoothed training click rate."""
        d = self.data
        items = d.feature(d.item_feature).ids[:, 0]  # [N]
        scores = popularity_scores(items[d.train_idx], d.labels[d.train_idx], items[d.test_idx])
        # nan AUC when the test split holds one class only (a small data set)
        return auc_logloss(d.labels[d.test_idx], torch.as_tensor(np.asarray(scores)))


def _position(pos: ReaderPosition) -> torch.Tensor:
    return torch.tensor([pos.file_index, pos.line, pos.skipped, pos.samples], dtype=torch.int64)


class StreamSource:
    """Files streamed and dealt to ranks by line (see the module docstring); a subclass
    says how to open a reader over some files."""

    def __init__(self, cfg: DLRMJobConfig, group: ProcessGroup) -> None:
        self.cfg, self.group = cfg, group
        self.per_rank = per_rank_batch(cfg, group)
        self.steps_per_epoch: int | None = None  # a stream: unknown
        # Malformed lines skipped by this rank (--skip-bad-lines): per training epoch
        # (a resumed reader's count includes the lines skipped before the checkpoint)
        # and in the last validation pass.
        self.skipped_train: dict[int, int] = {}
        self.skipped_val = 0

    def _reader(
        self, paths: list[str], batch: int, start: ReaderPosition | None, drop_last: bool
    ) -> CriteoReader | TabularReader:
        raise NotImplementedError

    def _split_paths(self, split: str) -> list[str]:
        raise NotImplementedError

    def train_batches(
        self, epoch: int, skip: int = 0, start: torch.Tensor | None = None
    ) -> Iterator[tuple[Batch, torch.Tensor]]:
        """``(batch, this rank's reader position after it)``; ``start`` resumes a position
        (``skip``, the steps already done in the epoch, is implied by it)."""
        del skip  # every epoch reads the files from the start (no shuffle of a stream)
        pos = None if start is None else ReaderPosition(*[int(v) for v in start.tolist()])
        reader = self._reader(self._split_paths("train"), self.per_rank, pos, True)
        for batch in reader:
            self.skipped_train[epoch] = reader.skipped
            yield batch, _position(dataclasses.replace(reader.position))
        self.skipped_train[epoch] = reader.skipped

    def has_split(self, split: str) -> bool:
        return bool(self._split_paths(split))

    def eval_batches(self, split: str) -> Iterator[Batch]:
        if not self.has_split(split):
            return iter(())
        reader = self._reader(self._split_paths(split), self.cfg.eval_batch_size, None, False)
        return self._counted(reader, split)

    def _counted(self, reader: CriteoReader | TabularReader, split: str) -> Iterator[Batch]:
        yield from reader
        if split == "val":
            self.skipped_val = reader.skipped

    def skipped_lines(self) -> tuple[int, int]:
        """This rank's malformed lines skipped: (training, last validation pass)."""
        return sum(self.skipped_train.values()), self.skipped_val

    def baseline(self) -> tuple[float, float] | None:
        return None

    encoders: Encoders  # how this source's files turn into batches

    def encoder_state(self) -> dict[str, Any] | None:
        """Criteo's hashing is all in the options: nothing to keep."""
        return None

    def value_names(self, feature: str) -> list[str] | None:
        return value_names(self.encoders, feature)


class CriteoSource(StreamSource):
    """Criteo TSV files, streamed."""

    def __init__(self, cfg: DLRMJobConfig, group: ProcessGroup) -> None:
        super().__init__(cfg, group)
        rows = cfg.criteo_rows or None
        self.features = [Feature(name, rows) for name in CAT_NAMES]
        self.num_dense = NUM_INT
        self.encoders = criteo_encoders(rows)

    def describe(self) -> str:
        rows = self.cfg.criteo_rows or "dynamic"
        return (
            f"criteo: {len(self.cfg.criteo_path)} file(s), 26 tables of {rows} rows, "
            f"13 dense features"
        )

    def _split_paths(self, split: str) -> list[str]:
        if split == "train":
            return list(self.cfg.criteo_path)
        return list(self.cfg.criteo_val_path) if split == "val" else []

    def _reader(
        self, paths: list[str], batch: int, start: ReaderPosition | None, drop_last: bool
    ) -> CriteoReader:
        cfg = CriteoConfig(
            paths=paths,
            batch_size=batch,
            num_rows=self.cfg.criteo_rows or None,
            rank=self.group.rank,
            world_size=self.group.size,
            skip_bad_lines=self.cfg.skip_bad_lines,
            drop_last=drop_last,
        )
        return CriteoReader(cfg, start)


class TabularSource(StreamSource):
    """The user's CSV/TSV/Parquet files read through a schema (``--data tabular``),
    streamed. Vocabularies and standardization come from one pass over the training
    files (every rank makes the same; a resumed run makes them again), or from a saved
    run (``encoders``, the state :meth:`encoder_state` gave): then files the run never
    saw encode as the run encoded its own, and the training files are not read."""

    def __init__(
        self, cfg: DLRMJobConfig, group: ProcessGroup, encoders: dict[str, Any] | None = None
    ) -> None:
        super().__init__(cfg, group)
        self.schema = load_schema(cfg.schema)
        if self.schema.label is None:
            raise ValueError(f"schema {cfg.schema}: --data tabular needs a [label] table")
        if encoders is None:
            self.fitted = fit_tabular(
                list(cfg.data_path), self.schema, skip_bad_lines=cfg.skip_bad_lines
            )
        else:
            self.fitted = TabularFit(encoders=saved_encoders(encoders, self.schema, cfg.schema))
        self.encoders = self.fitted.encoders
        self.features = [
            Feature(c.column, n, multi=c.separator is not None)
            for c, n in zip(self.schema.sparse, self.fitted.num_rows(), strict=True)
        ]
        self.num_dense = len(self.schema.dense)

    def describe(self) -> str:
        train = (
            f"{len(self.cfg.data_path)} file(s), {self.fitted.rows} training rows"
            if self.fitted.rows
            else "encoded as the saved run encoded"
        )
        return f"tabular: {train}, {len(self.features)} sparse + {self.num_dense} dense features"

    def encoder_state(self) -> dict[str, Any] | None:
        """The fitted vocabularies and statistics, as JSON data (a checkpoint keeps them)."""
        return self.encoders.to_state()

    def _split_paths(self, split: str) -> list[str]:
        return list(
            {"train": self.cfg.data_path, "val": self.cfg.data_val_path}.get(
                split, self.cfg.data_test_path
            )
        )

    def _reader(
        self, paths: list[str], batch: int, start: ReaderPosition | None, drop_last: bool
    ) -> TabularReader:
        cfg = TabularConfig(
            paths=paths,
            schema=self.schema,
            encoders=self.fitted.encoders,
            batch_size=batch,
            rank=self.group.rank,
            world_size=self.group.size,
            skip_bad_lines=self.cfg.skip_bad_lines,
            drop_last=drop_last,
        )
        return TabularReader(cfg, start)


Source = InMemorySource | CriteoSource | TabularSource


def open_source(
    cfg: DLRMJobConfig, group: ProcessGroup, encoders: dict[str, Any] | None = None
) -> Source:
    """The job's data; ``encoders``: a saved run's (:meth:`TabularSource.encoder_state`),
    so that new files encode as that run's did."""
    if cfg.data == "criteo":
        return CriteoSource(cfg, group)
    if cfg.data == "tabular":
        return TabularSource(cfg, group, encoders)
    fitted: Encoders | None = None
    saved = None if encoders is None else Encoders.from_state(encoders)
    if cfg.data == "recbole":
        data, fitted = read_recbole(
            cfg.data_path[0], recbole_schema(cfg), seed=cfg.seed,
            skip_bad_lines=cfg.skip_bad_lines, encoders=saved,
        )  # fmt: skip
    elif cfg.data == "movielens":
        data, fitted = read_movielens(seed=cfg.seed, encoders=saved)
    else:
        data = make_synthetic(
            num_samples=cfg.synthetic_samples,
            num_rows=cfg.synthetic_rows,
            seed=cfg.seed,
            zipf_a=cfg.synthetic_zipf,
        )
    return InMemorySource(data, cfg, group, fitted)


def recbole_schema(cfg: DLRMJobConfig) -> Schema | None:
    """The schema a RecBole-format run reads its folder with: MovieLens's own, the
    run's ``--schema``, or None (every field by its type)."""
    if cfg.data == "movielens":
        return schema_from_dict(MOVIELENS_SCHEMA)
    return load_schema(cfg.schema) if cfg.schema else None


def saved_encoders(state: dict[str, Any], schema: Schema, schema_path: str | None) -> Encoders:
    """A saved run's encoders, checked against the schema of this run: the same sparse
    columns in the same order (each is a table of the saved model)."""
    encoders = Encoders.from_state(state)
    saved = [e.name for e in encoders.sparse]
    now = [c.column for c in schema.sparse]
    if saved != now:
        raise ValueError(
            f"schema {schema_path}: sparse columns {now}, but the saved run encoded {saved} "
            "(evaluate with the schema the run trained with)"
        )
    return encoders


def value_names(encoders: Encoders | None, feature: str) -> list[str] | None:
    """What each row of ``feature``'s table stands for, where a vocabulary says
    (``names[row]``; row 0 is a value the vocabulary does not hold); None for hashed,
    bucketed or unknown features."""
    for e in encoders.sparse if encoders is not None else []:
        if e.name == feature and isinstance(e, VocabEncoder):
            return ["(other)", *e.vocab]
    return None


def auc_logloss(labels: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    y, p = labels.double().numpy(), probs.double().numpy()
    if len(y) == 0 or np.all(y == y[0]):
        return float("nan"), log_loss(y, p) if len(y) else float("nan")
    return roc_auc(y, p), log_loss(y, p)
