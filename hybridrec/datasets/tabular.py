"""The user's CSV, TSV and Parquet files read through a :class:`Schema`: rows parsed, streamed.

Files are CSV or TSV (plain or ``.gz``; the first line names the columns; ``\\n``
or ``\\r\\n`` line endings; no quoting) or Parquet (with the ``parquet`` extra).
Each data row is one sample, and this file parses it into the schema's columns:

* the label column's text;
* each dense column's number (empty: missing, which the encoder fills with 0); a
  value that is not a finite number makes the row malformed;
* each sparse column's field (text, or a Parquet list).

Turning them into features is the encoders' (:mod:`hybridrec.datasets.encode`, built
from the schema by :func:`tabular_encoders`): the label rule; ``log1p(max(x, 0))`` and
standardization with training-split statistics for a dense column; for a sparse
column, its ``separator`` (several values), then a vocabulary of the training split
(rows from 1 in sorted order, 0 for a value never seen in training) or hashing like a
Criteo categorical, ``splitmix64(value * 32 + k) mod hash_rows`` with ``k`` the
column's place among the sparse columns and ``value`` the hex integer
(``encoding = "hex"``) or the text's 8-byte BLAKE2b digest, either cut to 58 bits.

:func:`fit_tabular` reads the training files once for the vocabularies and the
standardization statistics (every rank the same, so every rank gets the same ids);
:class:`TabularReader` then streams rows dealt to ranks and resumable at a
:class:`~hybridrec.datasets.stream.ReaderPosition` (:mod:`hybridrec.datasets.stream`),
as the Criteo reader does.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from hybridrec.datasets.ctr import Batch, KeyRow
from hybridrec.datasets.encode import (
    DenseEncoder,
    Encoders,
    HashEncoder,
    LabelEncoder,
    Row,
    RowFit,
    SparseEncoder,
    VocabEncoder,
)
from hybridrec.datasets.schema import Schema
from hybridrec.datasets.stream import ReaderPosition, Record, RecordStream, decode_line


def file_format(path: str, schema: Schema) -> str:
    if schema.format is not None:
        return schema.format
    name = path[: -len(".gz")] if path.endswith(".gz") else path
    if name.endswith(".parquet") or name.endswith(".pq"):
        return "parquet"
    return "tsv" if name.endswith((".tsv", ".txt")) else "csv"


def tabular_encoders(schema: Schema) -> Encoders:
    """The schema's encoders, before the training split decides their vocabularies and
    statistics (:func:`fit_tabular`)."""
    sparse: list[SparseEncoder] = [
        VocabEncoder(name=c.column, separator=c.separator)
        if c.vocab
        else HashEncoder(
            name=c.column, salt=k, rows=c.hash_rows, encoding=c.encoding, separator=c.separator
        )
        for k, c in enumerate(schema.sparse)
    ]
    return Encoders(
        label=None
        if schema.label is None
        else LabelEncoder(column=schema.label.column, rule=schema.label.rule),
        dense=[
            DenseEncoder(name=c.column, log=c.log, standardize=c.standardize) for c in schema.dense
        ],
        sparse=sparse,
    )


def _text(v: Any) -> str | None:
    return None if v is None else v if isinstance(v, str) else str(v)


class _Parser:
    """One file's records -> :data:`~hybridrec.datasets.encode.Row` s, the header's
    column positions looked up once per header."""

    def __init__(
        self, schema: Schema, encoders: Encoders, delimiter: str | None, keys: Sequence[str] = ()
    ) -> None:
        self.schema, self.encoders, self.delimiter = schema, encoders, delimiter
        self.keys = list(keys)
        self._header: Any = None
        self._names: list[str] = []
        self._where: list[int] = []
        self._key_at: list[int] = []

    def _columns(self, header: Any, path: str) -> list[int]:
        if header is not self._header:
            names = header if self.delimiter is None else header.split(self.delimiter)
            self.schema.check_columns(names, path)
            missing = [k for k in self.keys if k not in names]
            if missing:
                raise ValueError(f"{path}: key column(s) {missing} not in its columns {names}")
            self._header, self._names = header, names
            self._where = [names.index(c) for c in self.schema.used_columns()]
            self._key_at = [names.index(k) for k in self.keys]
        return self._where

    def _values(self, rec: Record) -> Sequence[Any]:
        """The record's fields: a Parquet row's values, or a line decoded and split."""
        if self.delimiter is None:
            return rec.raw
        return decode_line(rec.raw, rec.where).split(self.delimiter)

    def __call__(self, rec: Record) -> Row:
        return self._row(rec, self._values(rec))

    def keyed(self, rec: Record) -> tuple[Row, KeyRow]:
        """The record's row, and ``(file index, line, key column texts)`` from the same
        fields (the line decoded once)."""
        values = self._values(rec)
        row = self._row(rec, values)
        return row, (rec.file_index, rec.line, [_text(values[i]) or "" for i in self._key_at])

    def _row(self, rec: Record, values: Sequence[Any]) -> Row:
        where = rec.where
        cols = self._columns(rec.header, rec.path)
        if len(values) != len(self._names):
            raise ValueError(
                f"{where}: expected {len(self._names)} fields (as the header), got {len(values)}"
            )
        s, enc = self.schema, self.encoders
        picked = [values[i] for i in cols]
        try:
            label = 0.0 if enc.label is None else enc.label.clicked(_text(picked[0]))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        picked = picked[0 if s.label is None else 1 :]
        dense: list[float] = []
        for dcol, v in zip(s.dense, picked, strict=False):
            t = _text(v)
            if t is None or t == "":
                dense.append(math.nan)
                continue
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
            dense.append(x)
        try:
            bags = [e.bag(v) for e, v in zip(enc.sparse, picked[len(s.dense) :], strict=True)]
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        return label, dense, bags


def _batches(
    paths: list[str],
    schema: Schema,
    encoders: Encoders,
    *,
    batch_size: int,
    rank: int,
    world_size: int,
    skip_bad_lines: bool,
    drop_last: bool,
    start: ReaderPosition,
    keys: Sequence[str] | None = None,
) -> Iterator[list[tuple[Row, KeyRow | None]]]:
    """This rank's parsed rows of ``paths`` in batches, each with where it is and its
    ``keys`` columns when ``keys`` is given (else None); ``start`` advances."""
    formats = {p: file_format(p, schema) for p in paths}
    parsers = {
        p: _Parser(
            schema, encoders, None if f == "parquet" else "\t" if f == "tsv" else ",", keys or ()
        )
        for p, f in formats.items()
    }
    stream: RecordStream[tuple[Row, KeyRow | None]] = RecordStream(
        paths, ["parquet" if formats[p] == "parquet" else "header" for p in paths],
        batch_size=batch_size, rank=rank, world_size=world_size, drop_last=drop_last,
        what="tabular data", start=start,
    )  # fmt: skip
    for rec in stream.records():
        parser = parsers[rec.path]
        try:
            parsed = (parser(rec), None) if keys is None else parser.keyed(rec)
        except ValueError:
            if not skip_bad_lines:
                raise
            stream.position.skipped += 1
            continue
        rows = stream.add(parsed)
        if rows is not None:
            yield rows
    rows = stream.rest()
    if rows is not None:
        yield rows


@dataclass(kw_only=True, slots=True)
class TabularFit:
    """What the training split decides: the fitted encoders, and how many rows it had."""

    encoders: Encoders
    rows: int = 0  # training rows read
    skipped: int = 0  # malformed training rows skipped

    def num_rows(self) -> list[int | None]:
        """Rows of each sparse column's table."""
        return self.encoders.num_rows()


def fit_tabular(paths: list[str], schema: Schema, *, skip_bad_lines: bool = False) -> TabularFit:
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
    encoders = tabular_encoders(schema)
    fit = RowFit(encoders)
    position = ReaderPosition()
    for rows in _batches(
        paths, schema, encoders, batch_size=4096, rank=0, world_size=1,
        skip_bad_lines=skip_bad_lines, drop_last=False, start=position,
    ):  # fmt: skip
        fit.add([row for row, _ in rows])
    if fit.rows == 0:
        raise ValueError(
            f"tabular data: the training split {paths} has no data rows"
            + (f" ({position.skipped} malformed, skipped)" if position.skipped else "")
        )
    return TabularFit(encoders=fit.fitted(), rows=fit.rows, skipped=position.skipped)


@dataclass(kw_only=True, slots=True)
class TabularConfig:
    paths: list[str]
    schema: Schema
    encoders: Encoders  # fitted on the training split (fit_tabular)
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

    @property
    def skipped(self) -> int:
        return self.position.skipped

    def __iter__(self) -> Iterator[Batch]:
        cfg = self.config
        for rows in _batches(
            cfg.paths, cfg.schema, cfg.encoders, batch_size=cfg.batch_size, rank=cfg.rank,
            world_size=cfg.world_size, skip_bad_lines=cfg.skip_bad_lines,
            drop_last=cfg.drop_last, start=self.position,
        ):  # fmt: skip
            yield cfg.encoders.batch([row for row, _ in rows])

    def keyed(self, keys: Sequence[str]) -> Iterator[tuple[Batch, list[KeyRow]]]:
        """Batches as :meth:`__iter__` gives them, each with its rows' ``(file index,
        line, key column texts)``: what scores written beside their rows need."""
        cfg = self.config
        for rows in _batches(
            cfg.paths, cfg.schema, cfg.encoders, batch_size=cfg.batch_size, rank=cfg.rank,
            world_size=cfg.world_size, skip_bad_lines=cfg.skip_bad_lines,
            drop_last=cfg.drop_last, start=self.position, keys=list(keys),
        ):  # fmt: skip
            yield (
                cfg.encoders.batch([row for row, _ in rows]),
                [k for _, k in rows if k is not None],
            )
