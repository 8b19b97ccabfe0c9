"""A streaming reader for the user's own tabular files, driven by a :class:`Schema`.

Files are CSV or TSV (plain or ``.gz``; the first line names the columns; ``\\n``
or ``\\r\\n`` line endings; no quoting) or Parquet (with the ``parquet`` extra).
Each data row is one sample:

* label: the schema's label column through its rule (``0/1`` or e.g. ``>= 4``);
* dense ``[B, D]`` float32: each dense column's number (missing: 0), through
  ``log1p(max(x, 0))`` if ``log``, then standardized with training-split
  statistics if ``standardize``;
* sparse: one jagged feature per sparse column, keyed by the column's name; a
  value becomes an id either from a vocabulary of the training split (ids from 1
  in sorted order, 0 for a value never seen in training) or hashed like a Criteo
  categorical, ``splitmix64(value * 32 + k) mod hash_rows`` with ``k`` the
  column's place among the sparse columns and ``value`` the hex integer
  (``encoding = "hex"``) or the text's 8-byte BLAKE2b digest, either cut to 58
  bits.

:func:`fit_tabular` reads the training files once for the vocabularies and the
standardization statistics (every rank the same, so every rank gets the same
ids); :class:`TabularReader` then streams rows dealt to ranks and resumable at a
:class:`~hybridrec.datasets.stream.ReaderPosition`, as the Criteo reader does.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from embedding import KeyedJaggedIds
from hybridrec.datasets.criteo import hash_categorical
from hybridrec.datasets.ctr import Batch
from hybridrec.datasets.schema import Schema
from hybridrec.datasets.stream import ReaderPosition, RecordStream, decode_line, open_lines

PARQUET_HINT = "pip install 'hybridrec[parquet]' (or pip install pyarrow)"
# Raw values keep 58 bits, so that ``value * 32 + k`` fits in an int64.
_MASK58 = (1 << 58) - 1

# A raw row: the file's column names and the row's values (text, None or a list).
RawRow = tuple[list[str], list[Any]]
# A parsed row: (label, dense values before standardizing, per sparse column its
# values: hashed ints or vocabulary tokens).
Row = tuple[float, list[float], list[list[int] | list[str]]]


def file_format(path: str, schema: Schema) -> str:
    if schema.format is not None:
        return schema.format
    name = path[: -len(".gz")] if path.endswith(".gz") else path
    if name.endswith(".parquet") or name.endswith(".pq"):
        return "parquet"
    return "tsv" if name.endswith((".tsv", ".txt")) else "csv"


@contextmanager
def _text_rows(path: str, delimiter: str) -> Iterator[Iterator[tuple[int, RawRow]]]:
    with open_lines(path, "tabular data") as f:
        first = f.readline()
        if not first:
            raise ValueError(f"tabular data: {path} is empty (expected a header line)")
        header = decode_line(first, f"{path}:1").split(delimiter)
        # The line stays bytes here; _LineParser decodes and splits it.
        yield ((i + 2, (header, raw)) for i, raw in enumerate(f))  # type: ignore[misc]


def _import_parquet() -> Any:
    try:
        import pyarrow.parquet as pq  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError:
        raise ImportError(
            f"reading Parquet files needs pyarrow, which is not installed; {PARQUET_HINT}"
        ) from None
    return pq


@contextmanager
def _parquet_rows(path: str) -> Iterator[Iterator[tuple[int, RawRow]]]:
    pq = _import_parquet()
    if not Path(path).is_file():
        raise FileNotFoundError(f"tabular data: {path} does not exist or is not a file")
    pf = pq.ParquetFile(path)
    header = list(pf.schema_arrow.names)

    def rows() -> Iterator[tuple[int, RawRow]]:
        n = 0
        for part in pf.iter_batches(batch_size=4096):
            columns = [part.column(i).to_pylist() for i in range(part.num_columns)]
            for values in zip(*columns, strict=True):
                n += 1
                yield n, (header, list(values))

    yield rows()


def open_rows(path: str, schema: Schema) -> Any:
    """A context manager giving ``(line number, (header, values))`` per data row."""
    fmt = file_format(path, schema)
    if fmt == "parquet":
        return _parquet_rows(path)
    return _text_rows(path, "\t" if fmt == "tsv" else ",")


def string_id(token: str) -> int:
    """A text value -> a 58-bit int (the low bits of its 8-byte BLAKE2b digest)."""
    return (
        int.from_bytes(hashlib.blake2b(token.encode(), digest_size=8).digest(), "little") & _MASK58
    )


class RowParser:
    """Raw rows -> :data:`Row`, the header's column positions looked up once per header."""

    def __init__(self, schema: Schema) -> None:
        self.schema = schema
        self._header: list[str] | None = None
        self._where: list[int] = []

    def _columns(self, header: list[str], where: str) -> list[int]:
        if header is not self._header:
            self.schema.check_columns(header, where.rsplit(":", 1)[0])
            self._header = header
            self._where = [header.index(c) for c in self.schema.used_columns()]
        return self._where

    def __call__(self, raw: RawRow, where: str) -> Row:
        header, values = raw
        cols = self._columns(header, where)
        if len(values) != len(header):
            raise ValueError(
                f"{where}: expected {len(header)} fields (as the header), got {len(values)}"
            )
        s = self.schema
        picked = [values[i] for i in cols]
        try:
            label = 0.0 if s.label is None else s.label.clicked(_text(picked[0]))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        picked = picked[0 if s.label is None else 1 :]
        dense: list[float] = []
        for dcol, v in zip(s.dense, picked, strict=False):
            t = _text(v)
            if t is None or t == "":
                x = 0.0
            else:
                try:
                    x = float(t)
                except ValueError:
                    raise ValueError(
                        f"{where}: column {dcol.column!r} must be a number, got {t!r} (an "
                        "empty field reads as 0; --skip-bad-lines counts and skips such "
                        'lines; RecBole data can fill = "mean" or "median" instead)'
                    ) from None
                if not math.isfinite(x):
                    raise ValueError(f"{where}: column {dcol.column!r} must be finite, got {t!r}")
            dense.append(math.log1p(max(x, 0.0)) if dcol.log else x)
        sparse: list[list[int] | list[str]] = []
        for col, v in zip(s.sparse, picked[len(s.dense) :], strict=True):
            tokens = _tokens(v, col.separator)
            if col.vocab:
                sparse.append(tokens)
            elif col.encoding == "hex":
                try:
                    sparse.append([int(t, 16) & _MASK58 for t in tokens])
                except ValueError:
                    raise ValueError(
                        f"{where}: column {col.column!r} must be hex, got {_text(v)!r}"
                    ) from None
            else:
                sparse.append([string_id(t) for t in tokens])
        return label, dense, sparse


def _text(v: Any) -> str | None:
    return None if v is None else v if isinstance(v, str) else str(v)


def _tokens(v: Any, separator: str | None) -> list[str]:
    if v is None:
        return []
    if isinstance(v, list):  # a Parquet list column
        return [str(x) for x in v if x is not None and str(x) != ""]
    t = str(v)
    if separator is None:
        return [t] if t != "" else []
    return [x for x in t.split(separator) if x != ""]


class _LineParser(RowParser):
    """Text lines: split by the delimiter, then :class:`RowParser`."""

    def __init__(self, schema: Schema, delimiter: str) -> None:
        super().__init__(schema)
        self.delimiter = delimiter

    def __call__(self, raw: RawRow, where: str) -> Row:
        header, line = raw
        return super().__call__((header, decode_line(line, where).split(self.delimiter)), where)  # type: ignore[arg-type]


def _parser(path: str, schema: Schema) -> RowParser:
    fmt = file_format(path, schema)
    if fmt == "parquet":
        return RowParser(schema)
    return _LineParser(schema, "\t" if fmt == "tsv" else ",")


@dataclass(slots=True)
class Fitted:
    """What the training split decides: vocabularies and standardization statistics."""

    vocabs: dict[str, dict[str, int]] = field(default_factory=dict)  # column -> token -> id
    mean: list[float] = field(default_factory=list)  # per dense column (0 if not standardized)
    std: list[float] = field(default_factory=list)  # per dense column (1 if not standardized)
    rows: int = 0  # training rows read
    skipped: int = 0

    def num_rows(self, schema: Schema) -> list[int]:
        """Rows of each sparse column's table."""
        return [len(self.vocabs[c.column]) + 1 if c.vocab else c.hash_rows for c in schema.sparse]


def _records(paths: list[str], schema: Schema, **kw: Any) -> RecordStream[RawRow, Row]:
    parsers = {p: _parser(p, schema) for p in paths}
    return RecordStream(
        paths,
        lambda p: open_rows(p, schema),
        lambda raw, where: parsers[where.rsplit(":", 1)[0]](raw, where),
        what="tabular data",
        **kw,
    )


def fit_tabular(paths: list[str], schema: Schema, *, skip_bad_lines: bool = False) -> Fitted:
    """One pass over the training files: vocabularies and dense statistics."""
    if schema.in_memory_options():
        raise ValueError(
            f"schema: {'; '.join(schema.in_memory_options())}: not for streamed tabular files "
            "(RecBole data sets only)"
        )
    if not schema.sparse:
        raise ValueError(
            "schema: needs at least one [[sparse]] column (the model has one embedding table "
            "per sparse column)"
        )
    tokens: dict[str, set[str]] = {c.column: set() for c in schema.sparse if c.vocab}
    nd = len(schema.dense)
    total = np.zeros(nd)
    total_sq = np.zeros(nd)
    stream = _records(
        paths, schema, batch_size=4096, rank=0, world_size=1,
        skip_bad_lines=skip_bad_lines, drop_last=False,
    )  # fmt: skip
    n = 0
    for rows in stream.batches():
        dense = np.asarray([r[1] for r in rows], dtype=np.float64).reshape(len(rows), nd)
        total += dense.sum(axis=0)
        total_sq += (dense**2).sum(axis=0)
        n += len(rows)
        for k, col in enumerate(schema.sparse):
            if col.vocab:
                bag = tokens[col.column]
                for r in rows:
                    bag.update(r[2][k])  # type: ignore[arg-type]
    if n == 0:
        raise ValueError(
            f"tabular data: the training split {paths} has no data rows"
            + (
                f" ({stream.position.skipped} malformed, skipped)"
                if stream.position.skipped
                else ""
            )
        )
    mean = total / n
    # The sample standard deviation, as hybridrec.datasets.ctr.standardize_ uses.
    var = (total_sq - n * mean**2) / max(n - 1, 1)
    std = np.sqrt(np.maximum(var, 0.0)).clip(min=1e-6)
    fitted = Fitted(rows=n, skipped=stream.position.skipped)
    for j, dcol in enumerate(schema.dense):
        fitted.mean.append(float(mean[j]) if dcol.standardize else 0.0)
        fitted.std.append(float(std[j]) if dcol.standardize else 1.0)
    for col in schema.sparse:
        if col.vocab:
            fitted.vocabs[col.column] = {t: i + 1 for i, t in enumerate(sorted(tokens[col.column]))}
    return fitted


@dataclass(kw_only=True, slots=True)
class TabularConfig:
    paths: list[str]
    schema: Schema
    fitted: Fitted
    batch_size: int = 2048  # samples per batch on this rank
    rank: int = 0
    world_size: int = 1
    skip_bad_lines: bool = False
    drop_last: bool = False

    def __post_init__(self) -> None:
        if not self.paths:
            raise ValueError("TabularConfig: paths is empty; give at least one data file")
        self.paths = [str(p) for p in self.paths]
        if self.batch_size < 1:
            raise ValueError(f"TabularConfig: batch_size must be >= 1, got {self.batch_size}")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"TabularConfig: need 0 <= rank < world_size, got rank {self.rank} "
                f"of world_size {self.world_size}"
            )


class TabularReader:
    """Iterates :class:`~hybridrec.datasets.ctr.Batch` es over ``config.paths``
    (see the module docstring); :attr:`position` resumes after the last batch."""

    def __init__(self, config: TabularConfig, start: ReaderPosition | None = None) -> None:
        self.config = config
        self.position = ReaderPosition() if start is None else start
        self.names = [c.column for c in config.schema.sparse]
        self._rows = config.fitted.num_rows(config.schema)
        self._mean = torch.tensor(config.fitted.mean, dtype=torch.float64)
        self._std = torch.tensor(config.fitted.std, dtype=torch.float64)

    @property
    def skipped(self) -> int:
        return self.position.skipped

    def __iter__(self) -> Iterator[Batch]:
        cfg = self.config
        stream = _records(
            cfg.paths, cfg.schema, batch_size=cfg.batch_size, rank=cfg.rank,
            world_size=cfg.world_size, skip_bad_lines=cfg.skip_bad_lines,
            drop_last=cfg.drop_last, start=self.position,
        )  # fmt: skip
        for rows in stream.batches():
            yield self.to_batch(rows)

    def to_batch(self, rows: list[Row]) -> Batch:
        b, schema = len(rows), self.config.schema
        nd = len(schema.dense)
        dense = torch.tensor([r[1] for r in rows], dtype=torch.float64).reshape(b, nd)
        dense = ((dense - self._mean) / self._std).to(torch.float32)  # [B, D]
        ids: list[torch.Tensor] = []
        lengths: list[torch.Tensor] = []
        for k, col in enumerate(schema.sparse):
            bags = [r[2][k] for r in rows]
            lengths.append(torch.tensor([len(bag) for bag in bags], dtype=torch.int64))
            flat = [v for bag in bags for v in bag]
            if col.vocab:
                vocab = self.config.fitted.vocabs[col.column]
                ids.append(torch.tensor([vocab.get(t, 0) for t in flat], dtype=torch.int64))  # type: ignore[arg-type]
            else:
                raw = torch.tensor(flat, dtype=torch.int64)
                ids.append(hash_categorical(raw, k, self._rows[k]))
        return Batch(
            dense=dense,
            sparse=KeyedJaggedIds(self.names, torch.cat(ids), torch.cat(lengths)),
            labels=torch.tensor([r[0] for r in rows], dtype=torch.float32),
        )
