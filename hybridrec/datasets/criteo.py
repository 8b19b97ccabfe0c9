"""The Criteo display-advertising TSV format: its lines parsed into rows, streamed.

Each line is one impression, 40 tab-separated fields::

    label \\t I1 ... I13 \\t C1 ... C26

* ``label``: 0 or 1 (clicked);
* ``I1..I13``: integer counts, possibly empty (missing) or negative; they become
  ``log1p(max(x, 0))`` with missing as 0, the usual DLRM preprocessing;
* ``C1..C26``: 32-bit categorical values written in hex (``"68fd1e64"``),
  possibly empty (missing).

A categorical value becomes one embedding id, mixed with its feature index so
that the same hex value in two features lands on unrelated rows:

* ``num_rows`` given: ``splitmix64(value * 32 + feature) mod num_rows``, an id in
  a fixed table of ``num_rows`` rows (the "hashing trick": collisions accepted);
* ``num_rows`` None: ``splitmix64(value * 32 + feature)`` with the sign bit
  cleared, a raw id for a dynamic (unbounded) table on the parameter server.

A missing categorical is an empty bag (no id): pooled, it contributes zeros.

This file parses the format; the encoding above is :func:`criteo_encoders`' (the
encoders of :mod:`hybridrec.datasets.encode`, the same ones a schema with ``log = true``
and ``encoding = "hex"`` builds), and the files are read line by line (plain or
``.gz``), never whole, through :mod:`hybridrec.datasets.stream`, which deals lines to
ranks round robin (rank ``r`` of ``n`` reads lines ``r, r + n, ...``) so every rank sees
a disjoint ``1/n`` of each file without any coordination. A malformed line raises
``ValueError`` naming the file and line number, or is counted and skipped with
``skip_bad_lines=True``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hybridrec.datasets.ctr import Batch
from hybridrec.datasets.encode import DenseEncoder, Encoders, HashEncoder
from hybridrec.datasets.stream import ReaderPosition, RecordStream, decode_line

NUM_INT = 13
NUM_CAT = 26
NUM_FIELDS = 1 + NUM_INT + NUM_CAT
INT_NAMES = [f"I{i}" for i in range(1, NUM_INT + 1)]
CAT_NAMES = [f"C{i}" for i in range(1, NUM_CAT + 1)]


@dataclass(kw_only=True, slots=True)
class CriteoConfig:
    """Where the TSV files are and how lines become batches."""

    paths: list[str]
    batch_size: int = 2048  # samples per batch on this rank
    num_rows: int | None = 100_000  # rows per table; None: raw ids for dynamic tables
    rank: int = 0
    world_size: int = 1
    skip_bad_lines: bool = False  # count and skip malformed lines instead of raising
    drop_last: bool = False  # drop a final batch smaller than batch_size

    def __post_init__(self) -> None:
        if isinstance(self.paths, str | Path):
            self.paths = [str(self.paths)]
        if not self.paths:
            raise ValueError("CriteoConfig: paths is empty; give at least one TSV file")
        self.paths = [str(p) for p in self.paths]
        if self.batch_size < 1:
            raise ValueError(f"CriteoConfig: batch_size must be >= 1, got {self.batch_size}")
        if self.num_rows is not None and self.num_rows < 1:
            raise ValueError(f"CriteoConfig: num_rows must be >= 1 or None, got {self.num_rows}")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"CriteoConfig: need 0 <= rank < world_size, got rank {self.rank} "
                f"of world_size {self.world_size}"
            )


def criteo_encoders(num_rows: int | None) -> Encoders:
    """The encoders of the Criteo features: ``log1p`` counts, hashed hex categoricals."""
    return Encoders(
        dense=[DenseEncoder(name=name, log=True) for name in INT_NAMES],
        sparse=[
            HashEncoder(name=name, salt=j, rows=num_rows, encoding="hex")
            for j, name in enumerate(CAT_NAMES)
        ],
    )


# A parsed line: (label, 13 counts (missing: NaN), 26 raw categorical values (None: missing)).
Line = tuple[float, list[float], list[int | None]]


def parse_line(raw: bytes, where: str) -> Line:
    """One line -> its label, counts and categorical values (see :data:`Line`)."""
    fields = decode_line(raw, where).split("\t")
    if len(fields) != NUM_FIELDS:
        raise ValueError(
            f"{where}: expected {NUM_FIELDS} tab-separated fields (label, {NUM_INT} integer, "
            f"{NUM_CAT} categorical), got {len(fields)}"
        )
    if fields[0] not in ("0", "1"):
        raise ValueError(f"{where}: label must be 0 or 1, got {fields[0]!r}")
    ints: list[float] = []
    for name, f in zip(INT_NAMES, fields[1 : 1 + NUM_INT], strict=True):
        try:
            ints.append(int(f) if f else math.nan)
        except ValueError:
            raise ValueError(f"{where}: field {name} must be an integer, got {f!r}") from None
    cats: list[int | None] = []
    for name, f in zip(CAT_NAMES, fields[1 + NUM_INT :], strict=True):
        if not f:
            cats.append(None)
            continue
        try:
            v = int(f, 16)
        except ValueError:
            raise ValueError(f"{where}: field {name} must be hex, got {f!r}") from None
        if not 0 <= v < 2**32:
            raise ValueError(f"{where}: field {name} must be a 32-bit hex value, got {f!r}")
        cats.append(v)
    return float(fields[0]), ints, cats


def encode_lines(encoders: Encoders, lines: list[Line]) -> Batch:
    """Parsed lines -> their columns -> the encoders' :class:`Batch`."""
    b = len(lines)
    cats = [r[2] for r in lines]
    present = np.array([[v is not None for v in row] for row in cats], dtype=bool)  # [B, 26]
    raw = np.array([[0 if v is None else v for v in row] for row in cats], dtype=np.int64)
    sparse = [(raw[present[:, j], j], present[:, j].astype(np.int64)) for j in range(NUM_CAT)]
    return encoders.encode(
        np.asarray([r[0] for r in lines], dtype=np.float32),
        np.asarray([r[1] for r in lines], dtype=np.float64).reshape(b, NUM_INT),  # [B, 13]
        sparse,
    )


class CriteoReader:
    """Iterates :class:`~hybridrec.datasets.ctr.Batch` es over the files of ``config``.

    ``batch.dense`` is float32 ``[B, 13]`` (``log1p`` of the clipped counts),
    ``batch.sparse`` has keys ``C1..C26`` (0 or 1 id each), ``batch.labels``
    float32 ``[B]``. :attr:`position` says how far it got; pass it back as
    ``start`` to resume after the last yielded batch.
    """

    def __init__(self, config: CriteoConfig, start: ReaderPosition | None = None) -> None:
        self.config = config
        self.position = ReaderPosition() if start is None else start
        self.encoders = criteo_encoders(config.num_rows)
        for p in config.paths:
            if not Path(p).is_file():
                raise FileNotFoundError(f"Criteo data: {p} does not exist or is not a file")

    @property
    def skipped(self) -> int:
        return self.position.skipped

    def __iter__(self) -> Iterator[Batch]:
        for lines in self._lines(False):
            yield encode_lines(self.encoders, [line for line, _ in lines])

    def keyed(self) -> Iterator[tuple[Batch, list[tuple[int, int, list[str]]]]]:
        """Batches as :meth:`__iter__` gives them, each with its rows' ``(file index,
        line, [])`` (a Criteo line has no named columns): what scores written beside
        their rows need."""
        for lines in self._lines(True):
            keys = [k for _, k in lines if k is not None]
            yield encode_lines(self.encoders, [line for line, _ in lines]), keys

    def _lines(
        self, with_keys: bool
    ) -> Iterator[list[tuple[Line, tuple[int, int, list[str]] | None]]]:
        """This rank's parsed lines in batches, each with where it is if ``with_keys``."""
        cfg = self.config
        stream: RecordStream[tuple[Line, tuple[int, int, list[str]] | None]] = RecordStream(
            cfg.paths, "lines", batch_size=cfg.batch_size, rank=cfg.rank,
            world_size=cfg.world_size, drop_last=cfg.drop_last, what="Criteo data",
            start=self.position,
        )  # fmt: skip
        for rec in stream.records():
            try:
                row = parse_line(rec.raw, rec.where)
            except ValueError:
                if not cfg.skip_bad_lines:
                    raise
                stream.position.skipped += 1
                continue
            lines = stream.add((row, (rec.file_index, rec.line, []) if with_keys else None))
            if lines is not None:
                yield lines
        lines = stream.rest()
        if lines is not None:
            yield lines
